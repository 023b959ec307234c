"""Redistributing a local tensor between placements with functional collectives.

Every collective is a ``torch.distributed._functional_collectives`` call, so it traces into the
per-rank graph as a ``_c10d_functional`` op that Inductor can schedule. Shard->Shard is a real
``all_to_all_single`` (DTensor's CPU redistribute falls back to all-gather + chunk on gloo,
torch 2.13). A shard (dim d, split factor sf) of a global dim of size sf*n*c holds, of each of the
sf blocks, the c elements at this rank's position.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor.placement_types import Placement

from ..propagate._placement import redistribute_kind, shard_spec

__all__ = ["redistribute"]


def _split(shape: list[int], d: int, parts: list[int]) -> list[int]:
    return shape[:d] + parts + shape[d + 1:]


def _slice(x: torch.Tensor, d: int, sf: int, n: int, rank: int) -> torch.Tensor:
    c = x.shape[d] // (sf * n)
    if sf == 1:
        return x.narrow(d, rank * c, c)
    shape = list(x.shape)
    return x.reshape(_split(shape, d, [sf, n, c])).select(d + 1, rank).reshape(_split(shape, d, [sf * c]))


def _gather(x: torch.Tensor, d: int, sf: int, n: int, group) -> torch.Tensor:
    shape = list(x.shape)
    c = shape[d] // sf
    y = funcol.all_gather_tensor(x.contiguous(), 0, group)  # (n*shape[0], ...): ranks stacked
    y = y.reshape([n] + _split(shape, d, [sf, c]))
    y = y.movedim(0, d + 1)  # (..., sf, n, c, ...)
    return y.reshape(_split(shape, d, [sf * n * c]))


def _reduce_scatter(x: torch.Tensor, d: int, sf: int, n: int, group) -> torch.Tensor:
    shape = list(x.shape)
    c = shape[d] // (sf * n)
    y = x.reshape(_split(shape, d, [sf, n, c])).movedim(d + 1, 0).contiguous()
    y = funcol.reduce_scatter_tensor(y, "sum", 0, group)
    return y.reshape(_split(shape, d, [sf * c]))


def _all_to_all(x: torch.Tensor, a: int, sfa: int, b: int, sfb: int, n: int, group) -> torch.Tensor:
    """Sharded on dim a (sfa) -> sharded on dim b (sfb): split b's blocks over the ranks, exchange,
    and put each source rank's piece of dim a in its place."""
    shape = list(x.shape)
    cb = shape[b] // (sfb * n)
    y = x.reshape(_split(shape, b, [sfb, n, cb])).movedim(b + 1, 0).contiguous()
    y = funcol.all_to_all_single(y, None, None, group)
    mid = _split(shape, b, [sfb * cb])
    ca = shape[a] // sfa
    y = y.reshape([n] + _split(mid, a, [sfa, ca]))
    y = y.movedim(0, a + 1)  # (..., sfa, n, ca, ...)
    return y.reshape(_split(mid, a, [sfa * n * ca]))


def redistribute(x: torch.Tensor, src: Placement, dst: Placement, n: int, rank: int, group) -> torch.Tensor:
    kind = redistribute_kind(src, dst)
    s, d = shard_spec(src), shard_spec(dst)
    if kind == "":
        return x if src == dst else _slice(x, *d, n, rank)
    if kind == "all_gather":
        return _gather(x, *s, n, group)
    if kind == "all_reduce":
        return funcol.all_reduce(x, "sum", group)
    if kind == "reduce_scatter":
        return _reduce_scatter(x, *d, n, group)
    if kind == "all_to_all":
        if s[0] == d[0]:  # same dim, other split factor: through the full tensor
            return _slice(_gather(x, *s, n, group), *d, n, rank)
        return _all_to_all(x, s[0], s[1], d[0], d[1], n, group)
    raise AssertionError(f"autosp: cannot redistribute {src} -> {dst}")
