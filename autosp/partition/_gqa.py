"""Grouped-query attention: K/V repeats folded into the kernel where the K/V heads split over the
ranks, and K/V heads replicated where they do not but the query heads do.

Models with fewer K/V heads than query heads often repeat K and V up to the query head count
before attention (Hugging Face's ``repeat_kv``, ``repeat_interleave(k, rep, dim=1)``). In the
joint graph that is ``unsqueeze(k, 2) -> expand -> clone -> view``, and its gradient is
``view -> sum(dim 2) -> squeeze``. The flash kernels (CPU's and CUDA's: ``AttentionOp.gqa``) take
the unrepeated K/V (query head j reads K/V head j // rep; forward and backward are identical to
the repeated call, measured to 1e-15 in fp64), so this pass hands the attention ops the
unrepeated K/V and takes the K/V gradients straight from the kernel. The repeated K/V and their
gradients (each as large as the query) are then never built: under checkpointing they were
rebuilt in the backward for every layer, and at the attention backward they were the largest transients.
A kernel that takes no grouped K/V (CUDA's memory-efficient one) gets them folded too: its
per-rank call repeats this rank's K/V just before the kernel (``_attention_ops.call_grouped``),
after the collectives, so ring attention passes and K/V gathers move the unrepeated K/V.

Folded only where nothing is lost: the K/V heads split evenly over the sp ranks (else the repeat
is what lets Ulysses split the heads), and the repeated K/V feed nothing but the attention ops.
When the gradient chain is not the exact mirror of the repeat, only the forward is folded and the
backward keeps the repeated K/V.

The other way round (``replicate_kv_heads``): where the query heads split over the n ranks and
the K/V heads inside the op do not (4 query and 2 K/V heads on 4 ranks), heads cannot split as
they are, and attention would run as a ring. Repeating each K/V head lcm(KV, n) / KV times before
the op (each rank then receives the K/V heads its query heads read, as DeepSpeed ALST replicates
them) lets Ulysses split the heads; the K/V gradients are summed back over the copies. The pass
takes this where its all-to-alls send fewer bytes than the ring (and the hybrid, on a 2D mesh),
by the same byte counts the solver uses, or where attention="ulysses" is forced.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from .._attention_ops import FORWARDS, attention_op, call_grouped
from .._context import Kernel, SpContext
from .._graph import hint, nbytes, out_vals
from ..errors import source_line
from ..propagate._attention import heads_split, hybrid_bytes, is_causal, ring_bytes, seq_attention_ok
from ..propagate._flex import FLEX, FLEX_BACKWARD
from ..propagate._placement import transfer_bytes

__all__ = ["fold_kv_repeats", "replicate_kv_heads"]

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _dim(nd: fx.Node, i: int, ndim: int):
    d = nd.args[i]
    return d % ndim if isinstance(d, int) else d


def _repeated(nd) -> tuple[fx.Node, int] | None:
    """(source, rep) when ``nd`` is a 4D (B, KV, S, D) source with each head repeated ``rep``
    times in place (head j = source head j // rep), built as unsqueeze(2) -> expand -> view."""
    if not isinstance(nd, fx.Node) or nd.target not in _VIEWS:
        return None
    out, x = out_vals(nd)[0], nd.args[0]
    chain = [x]
    if x.target is aten.clone.default:
        x = x.args[0]
        chain.append(x)
    if x.target is not aten.expand.default:
        return None
    wide, x = out_vals(x)[0], x.args[0]
    chain.append(x)
    if x.target is not aten.unsqueeze.default or _dim(x, 1, 5) != 2:
        return None
    src = x.args[0]
    s = out_vals(src)[0]
    if s is None or s.ndim != 4 or any(len(c.users) != 1 for c in chain):
        return None
    b, kv, t, d = s.shape
    rep = wide.shape[2]
    if tuple(wide.shape) != (b, kv, rep, t, d) or tuple(out.shape) != (b, kv * rep, t, d) or rep < 2:
        return None
    return src, rep


def _fake(a):
    if not isinstance(a, fx.Node):
        return a
    if a.op == "get_attr":  # a higher-order op's function (FlexAttention's score and mask)
        return getattr(a.graph.owning_module, a.target)
    v = a.meta.get("val")
    return v if isinstance(v, torch.SymInt) else out_vals(a)[0]


def _rerun(nd: fx.Node):
    """The node's op on its (new) inputs' fake values: its outputs' new shapes (fake tensors
    dispatch to their own mode); an attention op as it runs on grouped K/V (``call_grouped``)."""
    args, kwargs = tree_map(_fake, (nd.args, nd.kwargs))
    return call_grouped(nd.target, *args, **kwargs) if attention_op(nd.target) else nd.target(*args, **kwargs)


def _dims(g: fx.Graph, x: fx.Node, shape) -> list:
    """``x``'s sizes ``shape`` as a new node's arguments, a symbolic one as a ``sym_size`` node of
    ``x`` at the graph's insertion point (a graph's sizes are nodes, not raw SymInts)."""
    out = []
    for i, d in enumerate(shape):
        if isinstance(d, torch.SymInt):
            nd = g.call_function(aten.sym_size.int, (x, i))
            nd.meta["val"] = d
            d = nd
        out.append(d)
    return out


def _summed(grad: fx.Node, rep: int) -> fx.Node | None:
    """The end of the repeat's gradient chain view(B, KV, rep, S, D) -> sum(2, keepdim) -> squeeze(2)
    hanging alone off ``grad``, or None."""
    chain = [grad]
    for ok in (
        lambda n: (
            n.target in _VIEWS
            and out_vals(n)[0] is not None
            and out_vals(n)[0].ndim == 5
            and out_vals(n)[0].shape[2] == rep
        ),
        lambda n: (
            n.target is aten.sum.dim_IntList and [a % 5 for a in n.args[1]] == [2] and len(n.args) > 2 and n.args[2]
        ),
        lambda n: n.target is aten.squeeze.dim and _dim(n, 1, 5) == 2,
    ):
        if len(chain[-1].users) != 1:
            return None
        nxt = next(iter(chain[-1].users))
        if nxt.op != "call_function" or not ok(nxt):
            return None
        chain.append(nxt)
    return chain[-1]


def _forwards(g: fx.Graph) -> list[fx.Node]:
    """The attention forwards of ``g`` (every kernel of ``_attention_ops``: each takes query, key
    and value as its first three arguments, and its backward them after the incoming gradient)."""
    return [nd for nd in g.nodes if nd.op == "call_function" and nd.target in FORWARDS]


def _backwards(fwd: fx.Node, k: fx.Node, v: fx.Node) -> list[fx.Node]:
    """The backwards of ``fwd``'s kernel that read its K/V (FlexAttention's at arguments 1 and 2,
    the others' after the incoming gradient)."""
    if fwd.target is FLEX:
        return [u for u in k.users if u.target is FLEX_BACKWARD and u.args[1] is k and u.args[2] is v]
    bwd = attention_op(fwd.target).backward
    return [u for u in k.users if u.target is bwd and u.args[2] is k and u.args[3] is v]


def _with_kv(bwd: fx.Node, k: fx.Node, v: fx.Node) -> tuple:
    """``bwd``'s arguments reading ``k`` and ``v`` as its K/V."""
    at = 1 if bwd.target is FLEX_BACKWARD else 2
    return (*bwd.args[:at], k, v, *bwd.args[at + 2 :])


def fold_kv_repeats(gm: fx.GraphModule, n: int) -> list[str]:
    """Hand attention ops unrepeated K/V (see the module docstring), in place. Returns a note per
    folded attention op."""
    g, notes = gm.graph, []
    for fwd in _forwards(g):
        k, v = fwd.args[1], fwd.args[2]
        rk, rv = _repeated(k), _repeated(v)
        if rk is None or rv is None or rk[1] != rv[1] or out_vals(rk[0])[0].shape[1] % n:
            continue
        (ks, rep), (vs, _) = rk, rv
        bwds = _backwards(fwd, k, v)
        if set(k.users) != {fwd, *bwds} or set(v.users) != {fwd, *bwds}:
            continue
        fwd.args = (fwd.args[0], ks, vs, *fwd.args[3:])
        kept = 0
        for bwd in bwds:
            outs = {u.args[1]: u for u in bwd.users if u.target is operator.getitem and u.args[1] in (1, 2)}
            ends = {i: _summed(out, rep) for i, out in outs.items()}
            if None in ends.values():
                kept += 1  # this backward keeps the repeated K/V
                continue
            bwd.args = (*bwd.args[:2], ks, vs, *bwd.args[4:])
            bwd.meta["val"] = vals = _rerun(bwd)
            for i, end in ends.items():
                outs[i].meta["val"] = vals[i]
                end.replace_all_uses_with(outs[i])
                while end is not outs[i]:
                    prev = end.args[0]
                    g.erase_node(end)
                    end = prev
        for x in dict.fromkeys((k, v)):
            while not x.users and x.op == "call_function":
                prev = x.args[0]
                g.erase_node(x)
                x = prev
        if not attention_op(fwd.target).gqa:
            notes.append(
                f"attention at {source_line(fwd)}: K/V repeated {rep}x before it are moved unrepeated "
                f"(grouped-query attention, {out_vals(ks)[0].shape[1]} K/V heads), and repeated on each rank "
                f"just before the {attention_op(fwd.target).name} kernel, which takes no grouped K/V"
            )
            continue
        notes.append(
            f"attention at {source_line(fwd)}: K/V repeated {rep}x before it are handed to the kernel "
            f"unrepeated (grouped-query attention, {out_vals(ks)[0].shape[1]} K/V heads): the repeated K/V "
            + (
                "and their gradients are never built"
                if not kept
                else "are not built in the forward; the backward rebuilds them (its gradient chain is not the "
                "repeat's mirror)"
            )
        )
    if notes:
        g.lint()
        gm.recompile()
    return notes


# ---------------------------------------------------------------------------------------------
# K/V heads replicated for Ulysses

_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "partitioner_tag")


def _node(g: fx.Graph, target, args: tuple, like: fx.Node, **kwargs) -> fx.Node:
    """A new node computing ``target(*args, **kwargs)``, with ``like``'s place in the user's code
    and model (what the checkpointing pass and the error messages read) and its value on the fake
    inputs."""
    nd = g.call_function(target, args, kwargs)
    nd.meta.update({k: like.meta[k] for k in _META if k in like.meta})
    nd.meta["val"] = _rerun(nd)
    return nd


def _repeat(g: fx.Graph, x: fx.Node, rep: int, before: fx.Node) -> fx.Node:
    """(B, KV, S, D) -> (B, KV * rep, S, D), head j being ``x``'s head j // rep (``repeat_kv``)."""
    with g.inserting_before(before):
        B, KV, S, D = _dims(g, x, out_vals(x)[0].shape)
        e = _node(g, aten.expand.default, (_node(g, aten.unsqueeze.default, (x, 2), x), [B, KV, rep, S, D]), x)
        c = _node(g, aten.clone.default, (e,), x, memory_format=torch.contiguous_format)
        return _node(g, aten.view.default, (c, [B, KV * rep, S, D]), x)


def _sum_copies(g: fx.Graph, grad: fx.Node, rep: int) -> fx.Node:
    """The gradient of ``_repeat``: (B, KV * rep, S, D) summed over each head's copies."""
    with g.inserting_before(grad.next):  # right after grad, in this order
        B, H, S, D = _dims(g, grad, out_vals(grad)[0].shape)
        v = _node(g, aten.view.default, (grad, [B, H // rep, rep, S, D]), grad)
        s = _node(g, aten.sum.dim_IntList, (v, [2]), grad)
    sizes = {d for d in (B, H, S, D) if isinstance(d, fx.Node)}
    grad.replace_all_uses_with(s, delete_user_cb=lambda u: u is not v and u not in sizes)
    return s


def _a2a(x, n: int) -> float:
    return transfer_bytes("all_to_all", nbytes(x), n)


def _replicated_is_cheaper(fwd: fx.Node, q, k, v, rep: int, ctx: SpContext) -> bool:
    """Ulysses on the replicated K/V (q, K, V and the output all-to-all'd each way) against ring
    attention and, on a 2D mesh, hybrid attention on the heads as they are; for FlexAttention
    (no ring), against its K/V gathered in the forward and again in the backward, their gradients
    reduce-scattered."""
    n = ctx.n
    # sizes at their hints: a cost compared on the symbolic graph must not guard on the length
    out = math.prod(hint(tuple(q.shape[:3]))) * hint(v.shape[3]) * q.element_size()
    ulysses = 2 * (_a2a(q, n) + rep * (_a2a(k, n) + _a2a(v, n))) + 2 * transfer_bytes("all_to_all", out, n)
    others = [math.inf]
    if fwd.target is FLEX:
        kv = nbytes(k) + nbytes(v)
        others.append(2 * transfer_bytes("all_gather", kv, n) + transfer_bytes("reduce_scatter", kv, n))
    elif seq_attention_ok(fwd, q, k):
        others.append(sum(ring_bytes(q, k, v, n, is_causal(fwd))))
        u = ctx.ulysses
        if u > 1 and hint(q.shape[2]) % n == 0 and q.shape[1] % u == 0 and k.shape[1] % u == 0:
            others.append(sum(hybrid_bytes(q, k, v, n, u, is_causal(fwd))))
    return ulysses <= min(others)


def replicate_kv_heads(gm: fx.GraphModule, ctx: SpContext) -> list[str]:
    """Repeat K/V heads where only that lets Ulysses split the heads, and it is the cheaper plan
    (see the module docstring), in place. Returns a note per attention op."""
    n, g, notes = ctx.n, gm.graph, []
    if ctx.options.attention not in ("auto", Kernel.ULYSSES):
        return notes
    flex = [nd for nd in g.nodes if nd.op == "call_function" and nd.target is FLEX]
    for fwd in _forwards(g) + flex:
        k, v = fwd.args[1], fwd.args[2]
        q_, k_, v_ = (out_vals(a)[0] for a in fwd.args[:3])
        H, KV = q_.shape[1], k_.shape[1]
        if heads_split(q_, k_, n) or H % n or n > H or KV % n == 0 or H % KV:
            continue
        rep = math.lcm(KV, n) // KV
        if ctx.options.attention == "auto" and not _replicated_is_cheaper(fwd, q_, k_, v_, rep, ctx):
            continue
        kr, vr = _repeat(g, k, rep, fwd), _repeat(g, v, rep, fwd)
        fwd.args = (fwd.args[0], kr, vr, *fwd.args[3:])
        for bwd in _backwards(fwd, k, v):
            bwd.args = _with_kv(bwd, kr, vr)
            bwd.meta["val"] = vals = _rerun(bwd)
            for out in [u for u in bwd.users if u.target is operator.getitem and u.args[1] in (1, 2)]:
                out.meta["val"] = vals[out.args[1]]
                _sum_copies(g, out, rep)
        notes.append(
            f"attention at {source_line(fwd)}: {H} query / {KV} K/V heads: the K/V heads are replicated "
            f"{rep}x before the op so that Ulysses splits the heads (each rank gets the K/V heads its query "
            "heads read), fewer bytes than "
            + ("gathering K/V" if fwd.target is FLEX else "ring attention on the heads as they are")
        )
    if notes:
        g.lint()
        gm.recompile()
    return notes
