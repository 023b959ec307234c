"""Attention in the plan: its sharding rules, the ring's schedule, what each kernel sends, and the
notes ``explain`` prints. The kernels themselves run in ``partition._attention``.

An attention op can run with its heads split over the ranks (Ulysses: all-to-alls around it),
its batch split, or with the query sequence-sharded: against all-gathered K/V, as ring attention
(K/V chunks passed around the ranks), or on a 2D sp mesh as hybrid attention (Ulysses within
sub-groups, a ring across them). The rules offer every one that is exact; the solver weighs them
by the bytes each sends and holds.

The ring's schedule: rank r holds the contiguous chunk ``bounds(S, n)[r]`` of the sequence; at
step t it uses K/V chunk (r - t) mod n. Under a causal mask the queries move to a zigzag (rank r
runs query half-chunks r and 2n - 1 - r, an early one and a late one), so every rank computes
about the same number of blocks.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from .._attention_ops import ATTENTION, CPU_FLASH, FORWARDS, attention_op, input_names
from .._context import Kernel
from .._graph import hint, op_args, out_vals
from ..errors import PlanError, source_line
from ._flex import FLEX, flex_note
from ._placement import P, R, can_shard, chunks, offsets, shard, shard_specs
from ._strategy import Sets, Strategy, provenance, rule

__all__ = [
    "heads_split",
    "seq_attention_ok",
    "is_causal",
    "qkv",
    "mask_of",
    "hybrid_strategies",
    "ring_bytes",
    "hybrid_bytes",
    "attention_notes",
    "acc_dtype",
    "bounds",
    "halves",
    "zigzag",
    "zigzag_owner",
    "blocks",
    "ranges",
    "uses",
    "kv_sends",
]


def _val(node: fx.Node, idx: int = 0):
    return out_vals(node)[idx]


def _heads_error(node, heads, kv_heads, n):
    raise PlanError(
        node,
        f"{heads} query heads and {kv_heads} K/V heads (grouped-query attention inside the "
        f"attention op) cannot be split over sp={n} ranks: an uneven head split needs each query "
        "head's K/V head on the same rank",
        "repeat K/V to the query head count before attention (as Hugging Face's repeat_kv does), "
        "or use an sp size that divides both head counts",
    )


def heads_split(q, k, n) -> bool:
    """Whether attention can run with its heads split over the ranks: evenly (grouped-query blocks
    then align: query head j reads K/V head j // (H / KV)), or unevenly (balanced, e.g. 6 heads
    over 4 ranks: 2, 2, 1, 1) when every query head has its own K/V head at the op and every rank
    gets one."""
    H, KV = q.shape[1], k.shape[1]
    # no rank without heads: the CPU attention kernels divide by the head count (SIGFPE)
    return (H % n == 0 and KV % n == 0) or (H == KV and n <= H)


def qkv(node: fx.Node) -> tuple:
    """The fake query, key and value an attention op (forward or backward) reads."""
    args = op_args(node)
    return tuple(_val(args[name]) for name in ("query", "key", "value"))


def mask_of(node: fx.Node):
    """The fake mask (or bias) an attention op reads, None without one."""
    name = attention_op(node.target).mask
    mask = op_args(node).get(name) if name else None
    return _val(mask) if isinstance(mask, fx.Node) else None


def seq_attention_ok(node, q, k) -> bool:
    """Whether attention can run with the query sequence-sharded (K/V gathered, or passed around
    a ring): self-attention (the causal diagonal is where the query shard sits), a mask with a row
    per query and a column per key if any, and no dropout. ``autosp.partition._attention`` runs
    both on each rank."""
    mask = mask_of(node)
    # a mask (padding, documents): a row per query (or one for all), a column per key
    mask_ok = mask is None or (mask.ndim == 4 and tuple(mask.shape[-2:]) == (q.shape[2], k.shape[2]))
    return mask_ok and not op_args(node)["dropout_p"] and q.shape[2] == k.shape[2]


def is_causal(node) -> bool:
    return bool(op_args(node)["is_causal"])


# ---------------------------------------------------------------------------------------------
# rules: every kernel of ``_attention_ops.ATTENTION``, its tensors read by name


def _roles(node: fx.Node) -> tuple[str, ...]:
    """The tensor inputs that are split alike under sequence-sharded attention: (query, key,
    value) of a forward; (grad_out, query, key, value, out, logsumexp) of a backward."""
    op = attention_op(node.target)
    if node.target is op.forward:
        return ("query", "key", "value")
    return (op.grad_out, "query", "key", "value", "out", "logsumexp")


def _ins(node: fx.Node, mask=R, **placed) -> tuple:
    """A strategy's input placements in ``tensor_inputs`` order: ``placed`` by argument name,
    ``mask`` for the mask, the rest (the RNG state a backward reads) replicated."""
    name = attention_op(node.target).mask
    return tuple(placed.get(a, mask if a == name else R) for a in input_names(node))


def _outs(node: fx.Node, p, grads=None) -> tuple:
    """A strategy's output placements: ``p`` for the forward's output and log-sum-exp, or the
    backward's ``grads`` (of query, key, value; ``p`` each by default)."""
    op = attention_op(node.target)
    if node.target is op.forward:
        return op.forward_outs(node, p, R)
    grads = grads or (p, p, p)
    return tuple(grads[i] if i < 3 else o for i, o in enumerate(op.backward_outs(node, R)))


def _refuse(node: fx.Node) -> None:
    """What no strategy runs exactly: dropout in a kernel that draws its own mask (each rank would
    draw its heads' or rows' mask from the same seed, not the single device's), and a bias that
    takes a gradient (a learned bias: its gradient would need its own placement)."""
    op = attention_op(node.target)
    args = op_args(node)
    if any(args.get("grad_input_mask", ())[3:]):
        raise PlanError(
            node,
            f"the {op.name} kernel's attention bias requires grad (a learned bias)",
            "compute the bias from values that need no gradient, or plan on CPU",
        )
    if op.draws and args["dropout_p"]:
        raise PlanError(
            node,
            f"attention dropout (dropout_p={op_args(node)['dropout_p']}) inside the {op.name} kernel, which draws "
            "its own mask: split over the ranks, each would draw a different mask from the single device's",
            "set the attention dropout to 0 (Llama-style models train without it), or plan on CPU, where "
            "SDPA runs dropout as its own op",
        )


def _seq_strategies(node, q, k, v, n) -> list[Strategy]:
    """Sequence-sharded attention, offered wherever it is exact: ring attention, and attention
    against all-gathered K/V (which holds whole K/V on every rank, saved for the backward), each
    with a mask's rows split as the queries are (``_rows_mask``). The solver weighs them against
    Ulysses by the bytes each sends and holds: a whole (S, S) mask on every rank is what Ulysses
    costs under a document mask."""
    if n == 1 or not seq_attention_ok(node, q, k):  # one rank: attention runs whole (Ulysses over one)
        return []
    fwd, bwd = ring_bytes(q, k, v, n, is_causal(node))
    s2 = shard(2)
    m = _rows_mask(node, q)
    every = dict.fromkeys(_roles(node), s2)
    gathered = {**every, "key": R, "value": R}
    if node.target is attention_op(node.target).backward:
        # the gathered K/V's gradients: partial sums over the query shards
        return [
            Strategy(_outs(node, s2), _ins(node, m, **every), kernel=Kernel.RING, comm=bwd),
            Strategy(_outs(node, s2, (s2, P, P)), _ins(node, m, **gathered), kernel=Kernel.KV_GATHER),
        ]
    kv = (k.numel() + v.numel()) * k.element_size()
    return [
        Strategy(_outs(node, s2), _ins(node, m, **every), kernel=Kernel.RING, comm=fwd, held=kv / n),  # one in flight
        Strategy(_outs(node, s2), _ins(node, m, **gathered), kernel=Kernel.KV_GATHER, held=kv * (n - 1) / n),
    ]


def _rows_mask(node, q):
    """The mask's placement (if there is one) under sequence-sharded attention: a mask with a row
    per query (a document or padding mask of shape (B, 1|H, S, S)) follows the query rows, so no
    rank holds more than its rows of it (at 32k tokens a whole float mask is 4 GiB); a mask
    broadcast over the queries stays whole, and so does any mask under a causal flag (the zigzag
    moves the query rows; torch's SDPA never passes both)."""
    mask = mask_of(node)
    rows = mask is not None and mask.ndim == 4 and mask.shape[2] == q.shape[2] and not is_causal(node)
    return shard(2) if rows else R


def hybrid_strategies(node: fx.Node, A: Sets, n: int, u: int) -> list[Strategy]:
    """Hybrid attention on a 2D sp mesh (sub-groups of u ranks): Ulysses within each sub-group,
    ring across them. Offered where the head counts split over u (each sub-group rank then holds
    whole grouped-query blocks) and the sequence evenly over the ranks."""
    op = attention_op(node.target)
    if op is None:
        return []
    q, k, v = qkv(node)
    if (
        shard(2) not in A[input_names(node).index("query")]
        or not seq_attention_ok(node, q, k)
        or q.shape[2] % n
        or q.shape[1] % u
        or k.shape[1] % u
    ):
        return []
    fwd_bytes, bwd_bytes = hybrid_bytes(q, k, v, n, u, is_causal(node))
    s2 = shard(2)
    ins = _ins(node, R, **dict.fromkeys(_roles(node), s2))
    if node.target is op.forward:
        kv = (k.numel() + v.numel()) * k.element_size()
        return [Strategy(_outs(node, s2), ins, kernel=Kernel.HYBRID, comm=fwd_bytes, held=kv / n)]
    return [Strategy(_outs(node, s2), ins, kernel=Kernel.HYBRID, comm=bwd_bytes)]


def _split_mask(mask, q, dim: int):
    """The mask's placement (if there is a mask) when attention runs split along ``dim``."""
    return shard(dim) if mask is not None and mask.shape[dim] == q.shape[dim] and mask.ndim == 4 else R


def _split(node: fx.Node, q, dim: int) -> Strategy:
    """Attention with its heads (dim 1: Ulysses) or its batch (dim 0) split over the ranks."""
    s = shard(dim)
    return Strategy(
        _outs(node, s),
        _ins(node, _split_mask(mask_of(node), q, dim), **dict.fromkeys(_roles(node), s)),
        introduces=dim == 1,
        kernel=Kernel.ULYSSES if dim == 1 else Kernel.BATCH,
    )


@rule(*(k.forward for k in ATTENTION.values()))
def _attention_forward(node, A, n):
    _refuse(node)
    q, k, v = qkv(node)
    names = input_names(node)
    res = [Strategy(_outs(node, R), _ins(node))]
    seq = _seq_strategies(node, q, k, v, n)
    if shard(2) in A[names.index("query")]:
        res += seq
    for dim in (1, 0):
        if dim == 1 or any(shard(dim) in A[names.index(a)] for a in ("query", "key", "value")):
            if dim == 1 and not heads_split(q, k, n):
                if q.shape[1] % n and q.shape[1] >= n and not seq:
                    _heads_error(node, q.shape[1], k.shape[1], n)
                continue
            if dim == 0 and not (can_shard(q.shape[0], 1, n) and can_shard(k.shape[0], 1, n)):
                continue
            if dim == 0 and k.shape[0] != q.shape[0]:
                continue
            res.append(_split(node, q, dim))
    return res


@rule(*(k.backward for k in ATTENTION.values()))
def _attention_backward(node, A, n):
    _refuse(node)
    q, k, v = qkv(node)
    names = input_names(node)
    roles = _roles(node)
    res = [Strategy(_outs(node, R), _ins(node))]
    if shard(2) in A[names.index("query")]:
        res += _seq_strategies(node, q, k, v, n)
    for dim in (1, 0):
        if (dim == 1 and heads_split(q, k, n)) or (
            any(shard(dim) in A[names.index(a)] for a in roles)
            and dim == 0
            and can_shard(q.shape[0], 1, n)
            and can_shard(k.shape[0], 1, n)
        ):
            res.append(_split(node, q, dim))
    return res


@provenance(*ATTENTION)
def _attention_seq(node, A, n):
    """Attention's sequence correspondence: the query's sequence dim is the output's (and the
    log-sum-exp's); the gradients' are the inputs'. Not a strategy: the causal mask is global."""
    res = []
    for d, sf in shard_specs(A[input_names(node).index("query")]):
        if d == 2:
            p = shard(2, sf)
            res.append(Strategy(_outs(node, p), _ins(node, R, **dict.fromkeys(_roles(node), p))))
    return res


# ---------------------------------------------------------------------------------------------
# the ring's schedule (shared with the kernels in partition._attention)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged in: fp32 at least (as the kernels accumulate)."""
    return torch.promote_types(dtype, torch.float32)


def bounds(S: int, n: int) -> list[tuple[int, int]]:
    """(start, end) of each rank's contiguous chunk of a sequence of S."""
    cs = chunks(S, n)
    return [(o, o + c) for o, c in zip(offsets(cs), cs)]


def halves(S: int, n: int) -> list[tuple[int, int]]:
    """(start, end) of the 2n half-chunks: rank r's contiguous chunk is halves 2r and 2r + 1."""
    out = []
    for a, b in bounds(S, n):
        h = chunks(b - a, 2)[0]
        out += [(a, a + h), (a + h, b)]
    return out


def zigzag(r: int, n: int) -> tuple[int, int]:
    """The query half-chunks rank r runs under a causal mask."""
    return r, 2 * n - 1 - r


def zigzag_owner(h: int, n: int) -> int:
    return h if h < n else 2 * n - 1 - h


def blocks(qa: int, qb: int, ka: int, kb: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(first key, last key + 1, causal) of the kernel calls for queries ``qa..qb`` against keys
    ``ka..kb``. Query and key chunks come from the same split, so under a causal mask the keys
    are all before the queries, all after, or around them (ka <= qa < qb <= kb)."""
    if qa == qb or ka == kb:
        return []
    if not causal or kb <= qa:
        return [(ka, kb, False)]
    if ka >= qb:
        return []
    assert ka <= qa and qb <= kb, (qa, qb, ka, kb)
    return ([(ka, qa, False)] if qa > ka else []) + [(qa, qb, True)]


def ranges(S: int, n: int, rank: int, causal: bool) -> list[tuple[int, int]]:
    """The global query rows rank runs: its own chunk, or under a causal mask its zigzag halves."""
    if not causal:
        return [bounds(S, n)[rank]]
    hs = halves(S, n)
    return [hs[h] for h in zigzag(rank, n)]


def uses(S: int, n: int, rank: int, j: int, causal: bool) -> bool:
    """Whether rank's query rows see any key of chunk j."""
    ka, kb = bounds(S, n)[j]
    return any(blocks(qa, qb, ka, kb, causal) for qa, qb in ranges(S, n, rank, causal))


def kv_sends(S: int, n: int, rank: int, t: int, causal: bool) -> bool:
    """Whether rank sends its K/V chunk on at step t: always, but at the last pass only where the
    next rank uses it (nothing is forwarded after that)."""
    return t < n - 2 or uses(S, n, (rank + 1) % n, (rank - t) % n, causal)


# ---------------------------------------------------------------------------------------------
# what the kernels send


def ring_bytes(q, k, v, n: int, causal: bool) -> tuple[float, float]:
    """Bytes a rank sends (averaged over the ranks) in ring attention's forward and backward, for
    q, k, v of global shapes, following the kernels' schedule: the K/V chunks n - 1 times each way,
    the gradient accumulators n times (in the merge dtype), and under a causal mask the query-side
    rows the zigzag moves to another rank (q in, out and log-sum-exp back; grad_out, q, out,
    log-sum-exp in and grad q back)."""
    # at their hints: the graph K/V replication prices is the symbolic one (``partition._gqa``)
    return _ring_bytes(hint(tuple(q.shape)), hint(tuple(k.shape)), hint(tuple(v.shape)), q.dtype, n, causal)


@functools.lru_cache(maxsize=1024)  # propagation asks once per rule call; the walk is O(n^2) in Python
def _ring_bytes(q: tuple, k: tuple, v: tuple, dtype: torch.dtype, n: int, causal: bool) -> tuple[float, float]:
    item, acc = dtype.itemsize, acc_dtype(dtype).itemsize
    S = q[2]
    heads = q[0] * q[1]
    kv_row = q[0] * (k[1] * k[3] + v[1] * v[3]) * item
    q_row, o_row, l_row = heads * q[3] * item, heads * v[3] * item, heads * acc
    rows = [b - a for a, b in bounds(S, n)]
    kv = sum(rows[(r - t) % n] * kv_row for r in range(n) for t in range(n - 1) if kv_sends(S, n, r, t, causal))
    moved = sum(b - a for h, (a, b) in enumerate(halves(S, n)) if zigzag_owner(h, n) != h // 2) if causal else 0
    fwd = kv + moved * (q_row + o_row + l_row)
    bwd = kv + n * S * kv_row * acc / item + moved * (2 * q_row + 2 * o_row + l_row)
    return fwd / n, bwd / n


def hybrid_bytes(q, k, v, n: int, u: int, causal: bool) -> tuple[float, float]:
    """Bytes a rank sends (averaged) in hybrid attention's forward and backward: the all-to-alls
    within the sub-group ((u - 1) / u of each tensor's local bytes: q, k, v, out and the
    log-sum-exp forward; grad_out, q, k, v, out, log-sum-exp in and the three gradients back), and
    ring attention over the n / u sub-groups on H / u heads."""
    item, acc = q.element_size(), acc_dtype(q.dtype).itemsize
    B, H, S, D = hint(tuple(q.shape))
    frac = (u - 1) / u / n
    qb, kb, vb, ob, lb = (
        hint(q.numel()) * item,
        hint(k.numel()) * item,
        hint(v.numel()) * item,
        B * H * S * hint(v.shape[3]) * item,
        B * H * S * acc,
    )

    def sub(x):
        return x.shape[0], x.shape[1] // u, *x.shape[2:]

    ring_fwd, ring_bwd = _ring_bytes(sub(q), sub(k), sub(v), q.dtype, n // u, causal)
    fwd = frac * (qb + kb + vb + ob + lb) + ring_fwd
    bwd = frac * (ob + qb + kb + vb + ob + lb + qb + kb + vb) + ring_bwd
    return fwd, bwd


# ---------------------------------------------------------------------------------------------
# what explain says


def _note(nd: fx.Node, s: Strategy, n: int) -> str | None:
    q, k, _ = qkv(nd)
    H, KV = q.shape[1], k.shape[1]
    where = f"attention at {source_line(nd)}"
    heads = f"{H} query / {KV} K/V heads" + ("" if heads_split(q, k, n) else f" do not split over sp={n}")
    if s.kernel == Kernel.ULYSSES:
        if H % n:
            return (
                f"{where}: {H} heads split unevenly over sp={n} (heads per rank {chunks(H, n)}); "
                "the ranks with more heads set the pace of attention"
            )
        return None
    if s.kernel == Kernel.BATCH:
        return f"{where}: split over the batch ({q.shape[0]} sequences) instead of the heads"
    if s.kernel == Kernel.KV_GATHER:
        return (
            f"{where}: {heads}: the query stays sequence-sharded and K/V are all-gathered (their "
            "gradients reduce-scattered)"
        )
    if s.kernel == Kernel.RING:
        return (
            f"{where}: {heads}: ring attention, the query stays sequence-sharded and K/V chunks pass "
            f"around the ranks ({s.comm / 2**20:.3f} MiB sent per rank in the forward)"
            + (", causal work balanced by a zigzag of query half-chunks" if is_causal(nd) else "")
        )
    if s.kernel == Kernel.HYBRID:
        return (
            f"{where}: {heads}: hybrid attention, all-to-alls within sp sub-groups and a ring across "
            f"them ({s.comm / 2**20:.3f} MiB sent per rank in the forward)"
        )
    why = f"{H} query heads < sp={n}" if n > H else f"{H} query / {KV} K/V heads do not split over sp={n}"
    return (
        f"{where}: not Ulysses ({why}); it runs on inputs placed {s.ins[0]} (Q), {s.ins[1]} (K), "
        f"{s.ins[2]} (V): see the all-gathers above"
    )


def attention_notes(gm: fx.GraphModule, plan: dict[fx.Node, Strategy], n: int) -> list[str]:
    """The kernel attention runs as, where it is not the CPU one (a plan for a GPU's graph), and
    how each attention forward runs when it is not plain Ulysses (heads split evenly); none of the
    latter on an sp group of one rank, where attention runs whole wherever its inputs are placed."""
    forwards = [nd for nd in gm.graph.nodes if nd.op == "call_function" and nd.target in FORWARDS]
    kernels = dict.fromkeys(attention_op(nd.target) for nd in forwards)
    notes = [
        f"attention kernel: {op.name} ({op.forward.name()} and its backward), "
        f"{sum(nd.target is op.forward for nd in forwards)} op(s)"
        for op in kernels
        if op is not CPU_FLASH
    ]
    if n == 1:
        return notes
    notes += [_note(nd, plan[nd], n) for nd in forwards]
    notes += [flex_note(nd, plan[nd], n) for nd in gm.graph.find_nodes(op="call_function", target=FLEX)]
    return [x for x in notes if x is not None]
