"""Placements on the 1-D "sp" mesh axis: how a global tensor is laid out, its local shape, and
what moving it from one placement to another costs.

DTensor's vocabulary: ``Replicate()``, ``Partial()``, ``Shard(d)`` and ``_StridedShard(d, sf)``.
A strided shard appears when a sharded dim is flattened behind other dims, e.g. (b, s@sp, h)
viewed as (b*s, h): dim 0 is then ``_S(0, b)``, b blocks each split over the ranks.

A block that does not divide by the number of ranks is split unevenly, balanced: the first
``block % n`` ranks hold one element more (5 tokens over 2 ranks: 3 and 2; 3 over 4: 1, 1, 1, 0).
DTensor's own uneven layout (torch.chunk: 3 and 2, or 1, 1, 1, 0) differs only in which ranks
are short; the balanced split keeps every rank busy when the length is just over a multiple of n.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence

from torch import sym_min
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._graph import fixed

__all__ = [
    "R",
    "P",
    "shard",
    "shard_spec",
    "shard_specs",
    "is_shard",
    "local_shape",
    "chunk",
    "chunk_start",
    "even_split",
    "can_shard",
    "chunks",
    "offsets",
    "is_even",
    "redistribute_kind",
    "transfer_bytes",
    "placement_str",
    "parse_placement",
    "exact",
]

R = Replicate()
P = Partial()


def shard(dim: int, sf: int = 1) -> Placement:
    """``Shard(dim)`` when ``sf == 1``, else ``_StridedShard(dim, sf)``: one canonical form."""
    return Shard(dim) if sf == 1 else _StridedShard(dim, split_factor=sf)


def shard_spec(p: Placement) -> tuple[int, int] | None:
    """(dim, split_factor) of a sharded placement, None for Replicate and Partial."""
    if isinstance(p, _StridedShard):
        return p.dim, p.split_factor
    if isinstance(p, Shard):
        return p.dim, 1
    return None


def shard_specs(places: Iterable[Placement]):
    """(dim, split factor) of each sharded placement among ``places``, in a fixed order: set order
    follows str hashes, which differ between processes, and every rank must build the same
    integer program to reach the same plan."""
    for p in sorted(places, key=str):
        spec = shard_spec(p)
        if spec is not None:
            yield spec


def is_shard(p: Placement) -> bool:
    return shard_spec(p) is not None


def is_even(size: int, sf: int, n: int) -> bool:
    """Each of the ``sf`` blocks of a dim of ``size`` splits evenly over ``n`` ranks."""
    return size % (sf * n) == 0


def can_shard(size: int, sf: int, n: int) -> bool:
    """A non-empty dim of ``size`` splits into ``sf`` blocks, each evenly over ``n`` ranks."""
    return size > 0 and is_even(size, sf, n)


def chunks(block: int, n: int) -> list[int]:
    """How a block of ``block`` elements splits over ``n`` ranks (balanced): rank i holds
    ``ceil((block - i) / n)``, so the first ``block % n`` ranks hold one more. A symbolic block (a
    symbolic sequence length) gives symbolic chunks, with no guard on the length or its remainder."""
    return [chunk(block, n, i) for i in range(n)]


def offsets(cs: list[int]) -> list[int]:
    """Where each rank's chunk starts, for chunk sizes ``cs``."""
    return [0, *itertools.accumulate(cs[:-1])]


def chunk(block: int, n: int, i: int) -> int:
    """``chunks(block, n)[i]``, without the other ranks' chunks: on a symbolic length each is an
    expression the trace records, so a rank that reads only its own builds one, not ``n``."""
    block = fixed(block)
    if isinstance(block, int):
        return block // n + (i < block % n)
    if statically_known_true(block % n == 0):  # a compile guarded to lengths that divide
        return block // n
    return (block - i + n - 1) // n


def chunk_start(block: int, n: int, i: int) -> int:
    """``offsets(chunks(block, n))[i]``, where rank i's chunk starts, in closed form: the chunks
    before it are ``block // n`` rows each and one more for each of the first ``block % n``, so
    ``i * (block // n) + min(i, block % n)`` (one expression where the sum was ``i``)."""
    block = fixed(block)
    if isinstance(block, int):
        return i * (block // n) + min(i, block % n)
    if i == 0:
        return 0
    if statically_known_true(block % n == 0):
        return i * (block // n)
    return i * (block // n) + sym_min(i, block % n)


def even_split(block: int, n: int) -> bool:
    """Whether a block splits into ``n`` equal chunks; a symbolic one only where the compile's
    guards say it divides (``chunks``' equal chunks), without building the chunks."""
    block = fixed(block)
    if isinstance(block, int):
        return block % n == 0
    return statically_known_true(block % n == 0)


def local_shape(shape: Sequence[int], p: Placement, n: int, rank: int = 0) -> list[int]:
    """The shape ``rank`` holds of a global tensor of ``shape`` placed as ``p``."""
    out = list(shape)
    spec = shard_spec(p)
    if spec is not None:
        d, sf = spec
        out[d] = sf * chunk(out[d] // sf, n, rank)
    return out


def _reducible(p: Partial) -> bool:
    """A partial value autosp's redistribute reduces exactly: summed, a maximum or a minimum
    (all-reduce SUM, MAX, MIN), or a p-norm with finite p > 0 (the p-th powers summed, then the
    root). Anything else DTensor's strategies may produce (a product, an average, a masked
    partial) is not."""
    if type(p) is Partial:
        return p.reduce_op in ("sum", "max", "min")
    return type(p) is _NormPartial and math.isfinite(p.norm_type) and p.norm_type > 0


def exact(p: Placement | None, *, as_input: bool = False) -> bool:
    """Whether a placement is one autosp runs exactly: Replicate, a shard, or a reducible partial
    (as an op's input, only a sum: no rule reads a partial maximum or norm before its reduction)."""
    if p is None or type(p) in (Replicate, Shard, _StridedShard):
        return True
    if not isinstance(p, Partial):
        return False
    return p == P if as_input else _reducible(p)


def redistribute_kind(src: Placement, dst: Placement) -> str | None:
    """The collective that turns ``src`` into ``dst``: "" when free, None when not allowed."""
    if src == dst:
        return ""
    s, d = shard_spec(src), shard_spec(dst)
    if isinstance(src, Replicate):
        return "" if d is not None else None  # R -> P would need a zero fill: never needed
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return "all_reduce" if _reducible(src) else None
        return "reduce_scatter" if d is not None and src == P else None
    assert s is not None
    if isinstance(dst, Replicate):
        return "all_gather"
    if d is not None:
        return "all_to_all"
    return None


def transfer_bytes(kind: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for a collective on a tensor of ``nbytes`` global bytes (ring model)."""
    if kind == "":
        return 0.0
    frac = (n - 1) / n
    return {
        "all_to_all": nbytes / n * frac,
        "all_gather": nbytes * frac,
        "reduce_scatter": nbytes * frac,
        "all_reduce": 2 * nbytes * frac,
    }[kind]


def placement_str(p: Placement) -> str:
    """DTensor's short form, the one string form autosp stores in graphs: S(1), _S(0, 2), R, P(sum)."""
    return str(p)


def parse_placement(s: str) -> Placement:
    s = s.replace(" ", "")
    if s == "R":
        return Replicate()
    if s.startswith("P"):
        return Partial()
    m = re.fullmatch(r"S\((\d+)\)", s)
    if m:
        return Shard(int(m.group(1)))
    m = re.fullmatch(r"_S\((\d+),(\d+)\)", s)
    if m:
        return _StridedShard(int(m.group(1)), split_factor=int(m.group(2)))
    raise ValueError(f"autosp: cannot parse placement {s!r}; expected R, P, S(d) or _S(d, sf)")
