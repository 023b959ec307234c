"""Redistributing a local tensor between placements with functional collectives.

Every collective is a ``torch.distributed._functional_collectives`` call, so it traces into the
per-rank graph as a ``_c10d_functional`` op that Inductor can schedule. Shard->Shard is a real
``all_to_all_single`` (DTensor's CPU redistribute falls back to all-gather + chunk on gloo,
torch 2.13). A shard (dim d, split factor sf) of a global dim of size sf*B holds, of each of the
sf blocks of B elements, the chunk at this rank's position (``chunks``: balanced, so uneven when
n does not divide B). Uneven shards gather through padded buffers (as DTensor does) and exchange
with split sizes; even ones take the reshape-only paths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch import sym_max
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import Placement
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._graph import op_args
from ..propagate._placement import chunk, chunk_start, chunks, even_split, offsets, redistribute_kind, shard_spec

__all__ = ["redistribute", "pad_to", "drop_lone_collectives"]


def _split(shape: list[int], d: int, parts: list[int]) -> list[int]:
    return shape[:d] + parts + shape[d + 1 :]


def _slice(x: torch.Tensor, d: int, sf: int, n: int, rank: int) -> torch.Tensor:
    """This rank's shard of the full tensor ``x``."""
    shape = list(x.shape)
    block = shape[d] // sf
    rows = chunk(block, n, rank)
    y = x.reshape(_split(shape, d, [sf, block])).narrow(d + 1, chunk_start(block, n, rank), rows)
    return y.reshape(_split(shape, d, [sf * rows]))


def pad_to(x: torch.Tensor, d: int, size: int) -> torch.Tensor:
    if statically_known_true(x.shape[d] == size):
        return x
    fill = list(x.shape)
    fill[d] = size - x.shape[d]
    return torch.cat([x, x.new_zeros(fill)], dim=d)


def _unpadded_rows(block: int, n: int, device) -> torch.Tensor:
    """Where each row of a block of ``block`` rows lies among ``n`` chunks padded to the first's
    (balanced chunks: the first ``r = block % n`` ranks hold ``q + 1 = block // n + 1`` rows and
    the others ``q`` and one padded row each, when ``r > 0``): row p, past the ``r (q + 1)``
    rows of the first ranks, moves down by one padded row per rank before its own. Tensor ops
    whose number does not grow with ``n`` (on a symbolic length the chunks are expressions)."""
    q, first = block // n, chunk(block, n, 0)
    cut = (block - n * q) * first  # the rows of the ranks that hold ``first`` (no padding)
    p = torch.arange(block, device=device)
    pads = torch.where(p >= cut, (p - cut) // sym_max(q, 1), 0)
    return p + pads * (first - q)  # no padded rows where the chunks are equal


def _padded_rows(block: int, n: int, device) -> torch.Tensor:
    """For each of the ``n * first`` rows of ``n`` chunks padded to the first's, the row of the
    block it holds: rank j's rows from its start on, its padded row a copy of the block's last
    row (dropped after the exchange)."""
    q, first = block // n, chunk(block, n, 0)
    t = torch.arange(n * first, device=device)
    j = t // sym_max(first, 1)
    start = j * q + j.clamp(max=block - n * q)  # the first ``block % n`` ranks hold one row more
    return (start + t - j * first).clamp(max=sym_max(block - 1, 0))


def _gather(x: torch.Tensor, d: int, sf: int, n: int, group, block: int) -> torch.Tensor:
    """The full tensor from every rank's shard (``block``: the global block size)."""
    shape = list(x.shape)
    first = chunk(block, n, 0)
    c = shape[d] // sf
    y = x.reshape(_split(shape, d, [sf, c]))
    y = pad_to(y, d + 1, first).contiguous()
    y = funcol.all_gather_tensor(y, 0, group)  # ranks stacked on dim 0
    y = y.reshape([n] + _split(shape, d, [sf, first]))
    y = y.movedim(0, d + 1)  # (..., sf, n, c, ...)
    if not even_split(block, n):  # the padded rows out: one index, not a cut per rank
        y = y.flatten(d + 1, d + 2).index_select(d + 1, _unpadded_rows(block, n, y.device))
    return y.reshape(_split(shape, d, [sf * block]))


def _reduce_scatter(x: torch.Tensor, d: int, sf: int, n: int, rank: int, group) -> torch.Tensor:
    shape = list(x.shape)
    block = shape[d] // sf
    first, rows = chunk(block, n, 0), chunk(block, n, rank)
    y = x.reshape(_split(shape, d, [sf, block]))
    if not even_split(block, n):  # each rank's rows padded to the first's: one index, not a pad per rank
        y = y.index_select(d + 1, _padded_rows(block, n, y.device))
    y = y.reshape(_split(shape, d, [sf, n, first])).movedim(d + 1, 0).contiguous()
    y = funcol.reduce_scatter_tensor(y, "sum", 0, group)
    y = y.reshape(_split(shape, d, [sf, first])).narrow(d + 1, 0, rows)
    return y.reshape(_split(shape, d, [sf * rows]))


def _all_to_all(
    x: torch.Tensor, a: int, sfa: int, b: int, sfb: int, n: int, rank: int, group, block_a: int
) -> torch.Tensor:
    """Sharded on dim a (sfa) -> sharded on dim b (sfb): split b's blocks over the ranks, exchange,
    and put each source rank's piece of dim a in its place."""
    shape = list(x.shape)
    block_b = shape[b] // sfb
    even_a, even_b = even_split(block_a, n), even_split(block_b, n)
    if even_b and not even_a and sfa == 1:
        return _to_uneven_rows(x, a, b, sfb, n, group, chunks(block_a, n), block_b // n, block_a)
    if even_a and not even_b and sfb == 1:
        return _from_uneven_rows(x, a, b, sfa, n, rank, group, block_a // n, chunks(block_b, n))
    if even_a and even_b:
        ca, cb = block_a // n, block_b // n
        y = x.reshape(_split(shape, b, [sfb, n, cb])).movedim(b + 1, 0).contiguous()
        y = funcol.all_to_all_single(y, None, None, group)
        mid = _split(shape, b, [sfb * cb])
        y = y.reshape([n] + _split(mid, a, [sfa, ca]))
        y = y.movedim(0, a + 1)  # (..., sfa, n, ca, ...)
        return y.reshape(_split(mid, a, [sfa * n * ca]))
    ca, cb = chunks(block_a, n), chunks(block_b, n)
    # both uneven, or a strided shard on the uneven side: flat buffers with split sizes, piece j
    # of dim b to rank j (ops per rank: what a symbolic length on both dims, rare, costs)
    xb = x.reshape(_split(shape, b, [sfb, block_b]))
    send = [xb.narrow(b + 1, o, c).reshape(-1) for o, c in zip(offsets(cb), cb)]
    mids = []  # the shape of what rank j sends here: its chunk of a, this rank's chunk of b
    for j in range(n):
        m = list(shape)
        m[a], m[b] = sfa * ca[j], sfb * cb[rank]
        mids.append(m)
    recv_sizes = [math.prod(m) for m in mids]
    y = funcol.all_to_all_single(torch.cat(send), recv_sizes, [t.numel() for t in send], group)
    pieces = [p.reshape(_split(m, a, [sfa, ca[j]])) for j, (p, m) in enumerate(zip(y.split(recv_sizes), mids))]
    return torch.cat(pieces, dim=a + 1).reshape(_split(mids[0], a, [sfa * block_a]))


def _to_uneven_rows(
    x: torch.Tensor, a: int, b: int, sfb: int, n: int, group, ca: list, cb: int, block_a: int
) -> torch.Tensor:
    """Sharded on dim a (one block, uneven chunks ``ca``, a symbolic length's) -> sharded on dim b
    (even chunks of ``cb``): each rank's pieces laid out with dim a first, so that what the ranks
    send here, in rank order, is dim a whole, and the exchange's split sizes (rows of dim a) put
    each in its place: a fixed number of ops, not one per rank."""
    shape = list(x.shape)
    y = x.reshape(_split(shape, b, [sfb, n, cb]))  # dim b + 1: the rank each piece goes to
    at = a if a < b else a + 2
    y = y.movedim((b + 1, at), (0, 1)).contiguous()  # (n, rows of a here, ...)
    y = funcol.all_to_all_single(y.flatten(0, 1), list(ca), [shape[a]] * n, group)  # (rows of a, ...)
    mid = _split(shape, b, [sfb * cb])
    mid[a] = block_a
    return y.movedim(0, a if a < b else a + 1).reshape(mid)


def _from_uneven_rows(
    x: torch.Tensor, a: int, b: int, sfa: int, n: int, rank: int, group, ca: int, cb: list
) -> torch.Tensor:
    """Sharded on dim a (even chunks of ``ca``) -> sharded on dim b (one block, uneven chunks
    ``cb``, a symbolic length's): dim b first, so that rank j's piece is its rows of dim b, sent
    with split sizes; the pieces back here are alike in size and stack along dim a. A fixed
    number of ops, not one per rank."""
    shape = list(x.shape)
    y = x.movedim(b, 0).contiguous()  # (rows of b, ...)
    y = funcol.all_to_all_single(y, [cb[rank]] * n, list(cb), group)  # (n * this rank's rows of b, ...)
    rest = shape[:b] + shape[b + 1 :]
    at = a if a < b else a - 1  # dim a among the dims but b
    y = y.reshape([n, cb[rank], *_split(rest, at, [sfa, ca])])
    y = y.movedim(0, at + 2)  # (rows of b, ..., sfa, n, ca, ...): rank j's chunk in its place
    out = _split(rest, at, [sfa * n * ca])
    return y.reshape([cb[rank], *out]).movedim(0, b)


def _all_reduce(x: torch.Tensor, src, group) -> torch.Tensor:
    """A partial value reduced on every rank: summed, maximum or minimum; a p-norm's parts as
    the root of their summed p-th powers."""
    if isinstance(src, _NormPartial):
        return funcol.all_reduce(x.pow(src.norm_type), "sum", group).pow(1.0 / src.norm_type)
    return funcol.all_reduce(x, src.reduce_op, group)


def redistribute(
    x: torch.Tensor, src: Placement, dst: Placement, n: int, rank: int, group, global_shape: Sequence[int]
) -> torch.Tensor:
    """``x``, this rank's part of a tensor of ``global_shape`` placed as ``src``, placed as ``dst``."""
    if x.is_complex() and src != dst:  # gloo has no complex dtypes: move the (real, imaginary) pairs
        y = redistribute(torch.view_as_real(x), src, dst, n, rank, group, [*global_shape, 2])
        return torch.view_as_complex(y.contiguous())
    kind = redistribute_kind(src, dst)
    s, d = shard_spec(src), shard_spec(dst)
    if kind == "":
        return x if src == dst else _slice(x, *d, n, rank)
    if kind == "all_gather":
        return _gather(x, *s, n, group, global_shape[s[0]] // s[1])
    if kind == "all_reduce":
        return _all_reduce(x, src, group)
    if kind == "reduce_scatter":
        return _reduce_scatter(x, *d, n, rank, group)
    if kind == "all_to_all":
        if s[0] == d[0]:  # same dim, other split factor: through the full tensor
            return _slice(_gather(x, *s, n, group, global_shape[s[0]] // s[1]), *d, n, rank)
        return _all_to_all(x, s[0], s[1], d[0], d[1], n, rank, group, global_shape[s[0]] // s[1])
    raise AssertionError(f"autosp: cannot redistribute {src} -> {dst}")


_C10D = torch.ops._c10d_functional


def drop_lone_collectives(gm: torch.fx.GraphModule, group: str) -> int:
    """Remove from a per-rank graph every collective on ``group`` where the group is this rank
    alone (a world of one): each moves nothing and returns its input (a sum, maximum or gather of
    one part, an exchange with itself), so its result is its input, and its wait goes with it.
    Without them the checkpointing pass may recompute through what they fed (the partitioner
    saves every collective's result), as one GPU's step would. The number removed."""
    dropped = 0
    for nd in list(gm.graph.nodes):
        if nd.op != "call_function" or getattr(nd.target, "namespace", None) != "_c10d_functional":
            continue
        if nd.target is _C10D.wait_tensor.default:  # after its collective: kept where that was
            src = nd.args[0]
            pending = src.op == "call_function" and getattr(src.target, "namespace", None) == "_c10d_functional"
            if not pending or src.target is _C10D.wait_tensor.default:
                nd.replace_all_uses_with(src)
                gm.graph.erase_node(nd)
            continue
        if op_args(nd).get("group_name") != group or isinstance(nd.meta.get("val"), (list, tuple)):
            continue
        nd.replace_all_uses_with(nd.args[0])
        gm.graph.erase_node(nd)
        dropped += 1
    if dropped:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return dropped
