"""Sequence tiling: which ops of the per-rank graph may run in tiles along the local sequence.

Sharding along the sequence splits it over ranks in space; tiling splits a rank's share once more,
in time. The sharding plan already says which ops allow it: an op whose solved strategy maps
inputs sharded on the sequence to outputs sharded on it, with no collective on the way, computes
each output row from the same rows of its inputs (its sharding rule says so), so it also runs on
any contiguous tile of those rows; an op whose output is ``Partial`` from sequence-sharded inputs
is a sum over the rows (a weight gradient, a loss), so it runs per tile and the tiles' results
add up. Chains of such ops (normalisation, the MLP, the projections around attention, the
vocabulary projection with its loss, and all their gradients) run tile by tile: one tile's
intermediates are alive at a time, as in ALST's TiledMLP and tiled logits/loss, but found by the
compiler, not written by hand per model. Recomputed by the checkpointing pass, a tile is rebuilt
just before its gradient needs it (AOTAutograd's backward mimics the autograd engine's order),
so the backward's transient shrinks with the tile too.

Left out: collectives, attention kernels (their rows see every key), random ops (their draws
depend on the rows' place), autosp's own ops, strided shards (a batch flattened with the
sequence), ops with a size argument the tiler does not rewrite, and multi-output ops with a
``Partial`` output.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._context import SpContext
from .._graph import hint, is_attention, out_vals, tensor_inputs
from ..propagate._placement import P, chunk, chunks, local_shape, redistribute_kind, shard_spec

__all__ = ["Tiling", "TileGuard", "TileRunner", "plan_tiles", "MIN_TILE_ROWS", "MAX_TILES", "MOST_TILES", "SHAPE_ARG"]

aten = torch.ops.aten

# a floor on a tile's rows: per-op overhead grows with the tile count (small preset at 8192 tokens
# over 2, aot_eager, separate runs: 8 tiles of 512 rows ran 3.09 s a step, 4 tiles of 1024 3.11 s; not measured on
# a GPU, where small tiles waste more of a kernel)
MIN_TILE_ROWS = 512
# a group's tile count is capped at MAX_TILES, or where a tile's largest output would exceed one
# hidden state of the rank's rows (the logits' vocabulary-wide rows), at the power of two that
# brings it to that size, up to MOST_TILES: each tiled op appears once per tile in the graph, so
# compile time grows with the count (``_caps``)
MAX_TILES = 8
MOST_TILES = 256

# ops whose argument 1 is an output (or input) shape, rewritten per tile; argument 2 of the
# *_backward ops is the sliced dim, which must not be the tiled one
SHAPE_ARG = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.slice_backward.default,
    aten.select_backward.default,
}
_DIM_ARG = {aten.slice_backward.default, aten.select_backward.default}
_SIZE_NAMES = {"size", "sizes", "shape", "stride", "input_size", "input_sizes", "output_size", "self_sizes"}


@dataclass(frozen=True)
class Tiling:
    """The tiled ops (``nodes``, in graph order), each one's tiled dim (None for ``Partial``
    outputs: summed over the tiles), the group each runs in (``groups``: ``_groups``), the
    finest tiles' lengths along this rank's local sequence (``fine``), and how many fine tiles
    make one tile of each group (``spans``, each dividing the others' or divided by them): a
    group reads another group's tiles as a slice of one of them or a join of a few, never the
    whole value. Where every group has as many tiles, the fine tiles are the tiles."""

    nodes: dict[fx.Node, int | None]
    groups: dict[fx.Node, int]
    fine: tuple
    spans: tuple[int, ...]

    @property
    def count(self) -> int:
        """The most tiles of any group."""
        return len(self.fine) // min(self.spans)

    @property
    def counts(self) -> tuple[int, int]:
        """The fewest and the most tiles of a group."""
        return len(self.fine) // max(self.spans), self.count

    def span(self, nd: fx.Node) -> int:
        """How many fine tiles make one tile of ``nd``'s group."""
        return self.spans[self.groups[nd]]

    def start(self, k: int):
        """Where fine tile ``k`` starts."""
        return sum(self.fine[:k]) if k else 0

    def tiles(self, nd: fx.Node) -> list[tuple[object, object]]:
        """(start, rows) of each tile of ``nd``'s group."""
        m = self.span(nd)
        return [(self.start(j * m), sum(self.fine[j * m : (j + 1) * m])) for j in range(len(self.fine) // m)]


def _seq_dim(p, shape, n: int, rank: int) -> tuple[int, int] | None:
    """(dim, local length) of an output placed as a plain shard; None otherwise."""
    spec = shard_spec(p) if p is not None else None
    if spec is None or spec[1] != 1:
        return None
    return spec[0], local_shape(shape, p, n, rank)[spec[0]]


def _has_size_arg(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(a.name in _SIZE_NAMES and "[]" in str(a.type) for a in schema.arguments)


def _excluded(nd: fx.Node, kernel) -> bool:
    target = nd.target
    if target is operator.getitem:
        return False
    if not isinstance(target, torch._ops.OpOverload) or kernel is not None:
        return True
    if target.namespace in ("_c10d_functional", "autosp") or is_attention(target):
        return True
    if torch.Tag.nondeterministic_seeded in target.tags or target is aten.native_dropout.default:
        return True
    return target not in SHAPE_ARG and _has_size_arg(target)


def _candidate(nd: fx.Node, plan, n: int, rank: int) -> tuple[bool, int | None, int | None]:
    """(tileable, tiled dim (None: a partial sum over the tiles), global length of that dim) of
    one node on its own, before what its neighbours allow."""
    if nd.op != "call_function" or nd not in plan or _excluded(nd, plan[nd].kernel):
        return False, None, None
    s = plan[nd]
    ins = tensor_inputs(nd)
    if not ins or any(redistribute_kind(plan[u].outs[i], q) != "" for (u, i), q in zip(ins, s.ins)):
        return False, None, None  # no tensor input (a factory), or a collective on an input edge
    outs = [(p, v) for p, v in zip(s.outs, out_vals(nd)) if v is not None]
    if not outs:
        return False, None, None
    if all(p == P for p, _ in outs):
        return len(outs) == 1 and (nd.target is operator.getitem or len(out_vals(nd)) == 1), None, None
    dims = [_seq_dim(p, v.shape, n, rank) for p, v in outs]
    if any(d is None for d in dims) or len({d for d, _ in dims}) != 1 or len({L for _, L in dims}) != 1:
        return False, None, None
    d, _ = dims[0]
    if nd.target in _DIM_ARG and nd.args[2] % len(outs[0][1].shape) == d:
        return False, None, None
    return True, d, outs[0][1].shape[d]


def _tile_count(rows: int, cap: int, symbolic: bool) -> int:
    """How many tiles of at least ``MIN_TILE_ROWS`` a rank's ``rows`` make, at most ``cap``; with a
    symbolic length (``rows`` at its hint) a power of two, so the counts a run meets stay few."""
    counts = [t for t in range(cap, 1, -1) if not symbolic or t & (t - 1) == 0]
    return next((t for t in counts if rows >= t * MIN_TILE_ROWS), 1)


@dataclass(frozen=True)
class TileGuard:
    """What specialises a symbolic compile on its tile count, where the count matters to its plan
    (the checkpointing pass weighed tiled rungs): the local ``rows`` make ``tiles`` (its lower
    bound, and the next power of two's where that is within ``cap``), so a length that makes
    another count compiles again, once per count, never per length."""

    rows: object
    tiles: int
    cap: int

    def apply(self) -> None:
        if self.tiles > 1:
            torch._check(self.rows >= self.tiles * MIN_TILE_ROWS)
        if 2 * self.tiles <= self.cap:
            torch._check(self.rows < 2 * self.tiles * MIN_TILE_ROWS)


def _tile_sizes(rows, tiles: int) -> tuple:
    """The tiles' lengths: balanced; with a symbolic ``rows``, equal but the last, which takes the
    rest (no guard on ``rows % tiles``; every tile has rows, since ``rows >= tiles``)."""
    if isinstance(rows, int):
        return tuple(chunks(rows, tiles))
    c = rows // tiles
    return (c,) * (tiles - 1) + (rows - (tiles - 1) * c,)


def plan_tiles(
    graph: fx.Graph, plan, ctx: SpContext, tiles: int = MAX_TILES, symbolic: dict[fx.Node, fx.Node] | None = None
) -> tuple[Tiling | None, TileGuard | None]:
    """The ops of ``graph`` (solved ``plan``) that run in tiles along the local sequence (the
    most common sharded length): as many as fit ``MIN_TILE_ROWS`` rows each, at most ``tiles``;
    None when that is fewer than two or nothing can be tiled. ``symbolic``: ``graph`` is a
    hinted copy (``backend._symbolic``) and this maps its nodes to the symbolic graph's, which
    the tiling is then of (its tile lengths expressions of the symbolic length; the count read
    at the hint). With it, the compile's guard on the tile count (``TileGuard``; None otherwise):
    for the caller to apply where the count matters to the plan (the checkpointing pass weighs
    tiled rungs), so a compile whose rung is untiled serves every length."""
    n, rank = ctx.n, ctx.rank
    cand: dict[fx.Node, int | None] = {}
    lengths: dict[fx.Node, int] = {}
    for nd in graph.nodes:
        ok, d, length = _candidate(nd, plan, n, rank)
        if ok:
            cand[nd] = d
            if d is not None:
                lengths[nd] = length
    if not lengths:
        return None, None
    # the sequence: the most common global length of a sharded dim; the number of tiles from
    # the first rank's share (the longest), so that every rank tiles alike
    seq = Counter(lengths.values()).most_common(1)[0][0]
    if symbolic is not None:
        first = next(nd for nd, length in lengths.items() if length == seq)
        seq = next(v for v in out_vals(symbolic[first]) if v is not None).shape[cand[first]]
    longest = chunk(seq, n, 0)  # the first rank's share
    if _tile_count(hint(longest), tiles, symbolic is not None) < 2:
        return None, None if symbolic is None else TileGuard(longest, 1, tiles)
    rows = chunk(seq, n, rank)
    nodes = {nd: d for nd, d in cand.items() if d is None or lengths[nd] == hint(seq)}

    def sharded_input(u: fx.Node, i: int, q) -> bool:
        """An untiled input the op reads sequence-sharded, of the tiled length: sliced."""
        spec = _seq_dim(q, out_vals(u)[i].shape, n, rank)
        return spec is not None and spec[1] == hint(rows)

    # every tiled op's sharded input has the tiled length (it is sliced into the same tiles)
    for nd in [nd for nd, d in nodes.items() if d is not None]:
        for (u, i), q in zip(tensor_inputs(nd), plan[nd].ins):
            if shard_spec(q) is not None and u not in nodes and not sharded_input(u, i, q):
                del nodes[nd]
                break
    changed = True
    while changed:  # a tile's partial sum needs every partial input tiled too, and one tiled input
        changed = False
        for nd in [nd for nd, d in nodes.items() if d is None]:
            ins = list(zip(tensor_inputs(nd), plan[nd].ins))
            ok = all(u in nodes for (u, i), _ in ins if plan[u].outs[i] == P) and any(
                u in nodes or sharded_input(u, i, q) for (u, i), q in ins
            )
            if not ok:
                del nodes[nd]
                changed = True
    if not any(d is not None for d in nodes.values()):
        return None, None
    groups = _groups(graph, nodes)
    caps = _caps(nodes, groups, tiles)
    # each group's count from the first rank's share; with a symbolic length, powers of two under
    # powers-of-two caps, so the guard on the largest cap's count fixes every group's. Each is
    # a multiple of the fewest: a group's tiles cut the coarsest tiles further
    counts = [_tile_count(hint(longest), cap, symbolic is not None) for cap in caps]
    guard = None if symbolic is None else TileGuard(longest, max(counts), max(caps))
    # the fewest times a power of two (a symbolic length's counts are powers of two already)
    fewest = min(counts)
    counts = [fewest << (c // fewest).bit_length() - 1 for c in counts]
    most = max(counts)
    if symbolic is not None:
        nodes = {symbolic[nd]: d for nd, d in nodes.items()}
        groups = {symbolic[nd]: g for nd, g in groups.items()}
    return Tiling(nodes, groups, _tile_sizes(rows, most), tuple(most // c for c in counts)), guard


def _groups(graph: fx.Graph, nodes: dict[fx.Node, int | None]) -> dict[fx.Node, int]:
    """Each tiled op's group: the ops ``TileRunner`` runs together (those waiting when an untiled
    op, or the output, reads one of them), joined where one group's partial sum is read by
    another's (the tiles' partial results add up tile by tile: both run in the same tiles).
    Numbered in graph order."""
    flushes: list[list[fx.Node]] = []
    waiting: list[fx.Node] = []
    run: set[fx.Node] = set()
    for nd in graph.nodes:
        if nd in nodes:
            waiting.append(nd)
        elif waiting and (nd.op == "output" or any(u in nodes and u not in run for u in nd.all_input_nodes)):
            flushes.append(waiting)
            run.update(waiting)
            waiting = []
    flushes += [waiting] if waiting else []
    first = {nd: i for i, group in enumerate(flushes) for nd in group}
    root = list(range(len(flushes)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for nd in nodes:
        for u in nd.all_input_nodes:
            if u in nodes and nodes[u] is None:
                root[find(first[u])] = find(first[nd])
    ids: dict[int, int] = {}
    return {nd: ids.setdefault(find(first[nd]), len(ids)) for nd in nodes}


def _row_bytes(v: torch.Tensor, d: int) -> int:
    """Bytes of one row of ``v`` along dim ``d``."""
    shape = hint(tuple(v.shape))
    return (math.prod(shape) // max(shape[d], 1)) * v.dtype.itemsize


def _caps(nodes: dict[fx.Node, int | None], groups: dict[fx.Node, int], tiles: int) -> list[int]:
    """Each group's cap on its tile count: ``tiles``, or where a tile of that many would still
    hold an output larger per row than a hidden state (the tiled outputs' most common row size),
    the power of two that brings the group's largest output to a hidden state's size over the
    rank's rows (at most ``MOST_TILES``): the logits' vocabulary-wide rows against the model's
    width. A tile's transient is then about one hidden state whatever the vocabulary, as ALST
    sizes its tiled loss by hand (its tiled MLP by the width: tiles of the width's rows)."""
    rows = {nd: _row_bytes(v, d) for nd, d in nodes.items() if d is not None for v in out_vals(nd) if v is not None}
    counted = Counter(rows.values())
    hidden = max(counted, key=lambda b: (counted[b], b))
    largest: dict[int, int] = {}
    for nd, b in rows.items():
        largest[groups[nd]] = max(largest.get(groups[nd], 0), b)
    caps = []
    for g in range(max(groups.values()) + 1):
        ratio = max(1, -(-largest.get(g, 0) // hidden))
        caps.append(min(MOST_TILES, max(tiles, 1 << (ratio - 1).bit_length())))
    return caps


def _item(v, u: fx.Node, i: int):
    """Output i of a value held for node u (a getitem's value is its item already)."""
    return v[i] if u.target is not operator.getitem and isinstance(v, (tuple, list)) else v


class TileRunner:
    """Runs a tiling's ops for a per-rank interpreter (``partition._localize.Localizer``): each
    tiled op waits (``defers``) until an untiled op (or the output) reads one of the waiting ops;
    then the waiting ops run one tile through all of them, then the next (each group in its own
    tiles, ``Tiling.tiles``). A tiled op read untiled is its tiles joined along the sequence
    (``joined``); a partial sum read untiled (a weight gradient, the loss) is added up as the
    tiles go."""

    def __init__(self, interp, tiling: Tiling):
        self.interp, self.tiling = interp, tiling
        self.waiting: list[fx.Node] = []
        self.parts: dict[fx.Node, list] = {}  # a tiled op's result per tile

    def defers(self, nd: fx.Node) -> bool:
        """Whether ``nd`` waits to run in tiles; before a node that reads a waiting one, the
        waiting ones run."""
        tiled = self.tiling.nodes
        if nd in tiled:
            self.waiting.append(nd)
            return True
        if self.waiting and (nd.op == "output" or any(u in tiled and u not in self.parts for u in nd.all_input_nodes)):
            self._run(self.waiting)
            self.waiting = []
        return False

    def joined(self, u: fx.Node):
        """A tiled op's value read untiled: its tiles joined along the sequence."""
        v, d = self.parts[u], self.tiling.nodes[u]
        if isinstance(v[0], (tuple, list)):
            return type(v[0])(torch.cat(list(t), d) if isinstance(t[0], torch.Tensor) else t[0] for t in zip(*v))
        return torch.cat(v, d)

    def _run(self, ops: list[fx.Node]) -> None:
        """The waiting ops, group by group (``Tiling.groups``), each in its group's tiles."""
        groups = self.tiling.groups
        for g in dict.fromkeys(groups[nd] for nd in ops):
            self._run_group([nd for nd in ops if groups[nd] == g])

    def _run_group(self, ops: list[fx.Node]) -> None:
        interp, tiling, tiled = self.interp, self.tiling, self.tiling.nodes
        span = tiling.span(ops[0])
        summed = {nd for nd in ops if tiled[nd] is None and any(u not in tiled for u in nd.users)}
        sliced: dict[tuple, torch.Tensor] = {}
        for j, (start, rows) in enumerate(tiling.tiles(ops[0])):

            def tile(u: fx.Node, i: int, q, j=j, start=start, rows=rows) -> torch.Tensor:
                if u in tiled:
                    theirs = tiling.span(u)
                    if theirs == span:
                        return _item(self.parts[u][j], u, i)
                    if theirs < span:  # another group's finer tiles: the few that make this one, joined
                        k = span // theirs
                        return torch.cat([_item(t, u, i) for t in self.parts[u][j * k : (j + 1) * k]], tiled[u])
                    # another group's coarser tile: the slice of it that is this tile
                    p = j * span // theirs
                    offset = sum(tiling.fine[p * theirs : j * span])
                    return _item(self.parts[u][p], u, i).narrow(tiled[u], offset, rows)
                spec = shard_spec(q)
                if spec is None:
                    return interp.value(u, i)
                if (u, i, q, j) not in sliced:  # this rank's rows (a free slice of a replicated input), this tile's
                    sliced[u, i, q, j] = interp.redistributed(u, i, q).narrow(spec[0], start, rows)
                return sliced[u, i, q, j]

            for nd in ops:
                with fx.traceback.set_current_meta(nd):
                    local = [tile(u, i, q) for (u, i), q in zip(tensor_inputs(nd), interp.plan[nd].ins)]
                    out = interp.call(nd, local, None if tiled[nd] is None else (tiled[nd], rows))
                    self.parts.setdefault(nd, []).append(out)
                    if nd in summed:
                        interp.env[nd] = out if j == 0 else interp.env[nd] + out
