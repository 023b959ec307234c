"""Grouped-query attention without repeated K/V.

Models with fewer K/V heads than query heads often repeat K and V up to the query head count
before attention (Hugging Face's ``repeat_kv``, ``repeat_interleave(k, rep, dim=1)``). In the
joint graph that is ``unsqueeze(k, 2) -> expand -> clone -> view``, and its gradient is
``view -> sum(dim 2) -> squeeze``. The CPU flash kernel takes the unrepeated K/V itself (query head
j reads K/V head j // rep; forward and backward are identical to the repeated call, measured to
1e-15 in fp64), so this pass hands the attention ops the unrepeated K/V and takes the K/V
gradients straight from the kernel. The repeated K/V and their gradients (each as large as the
query) are then never built: under checkpointing they were rebuilt in the backward for every
layer, and at the attention backward they were the largest transients.

Folded only where nothing is lost: the K/V heads split evenly over the sp ranks (else the repeat
is what lets Ulysses split the heads), and the repeated K/V feed nothing but the attention ops.
When the gradient chain is not the exact mirror of the repeat, only the forward is folded and the
backward keeps the repeated K/V.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._graph import SDPA_CPU as _FWD
from .._graph import SDPA_CPU_BACKWARD as _BWD
from .._graph import out_vals
from ..errors import source_line

__all__ = ["fold_kv_repeats"]

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


def fold_kv_repeats(gm: fx.GraphModule, n: int) -> list[str]:
    """Hand attention ops unrepeated K/V (see the module docstring), in place. Returns a note per
    folded attention op."""
    g, notes = gm.graph, []
    for fwd in list(g.find_nodes(op="call_function", target=_FWD)):
        k, v = fwd.args[1], fwd.args[2]
        rk, rv = _repeated(k), _repeated(v)
        if rk is None or rv is None or rk[1] != rv[1] or out_vals(rk[0])[0].shape[1] % n:
            continue
        (ks, rep), (vs, _) = rk, rv
        bwds = [u for u in k.users if u.target is _BWD and u.args[2] is k and u.args[3] is v]
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
            # the kernel's outputs on the fake inputs (fake tensors dispatch to their own mode)
            fake = lambda a: out_vals(a)[0] if isinstance(a, fx.Node) else a  # noqa: E731
            bwd.meta["val"] = vals = bwd.target(*map(fake, bwd.args), **{key: fake(a) for key, a in bwd.kwargs.items()})
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
