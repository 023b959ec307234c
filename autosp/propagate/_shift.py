"""Shifts along a sharded dim as halo exchanges (GSPMD's halo): a slice with offsets, padding,
and the slice's gradient move only the boundary rows each rank needs from the ranks that hold
them, never the whole tensor.

Each op is a window: output row j is input row ``j + offset`` where that lies in the input, else
``fill`` (``Window``). Input and output are both split balanced (``chunks``) over their own
lengths, so a rank's output rows mostly lie on the same rank's input: ``logits[:, :-1]`` over a
length that divides by the ranks moves nothing, ``F.pad(x, (0, 0, 1, -1))`` (a token shift) one
row per boundary. ``halo_pieces`` is the schedule every rank computes alike; ``partition._shift``
runs it with one all-to-all (skipped when nothing moves). The rules here replace the ones that
made these ops read their input whole (an all-gather of, e.g., the logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._context import Kernel
from .._graph import hint, out_vals, tensor_inputs
from .._lengths import arithmetic
from ._placement import P, R, chunks, offsets, shard, shard_specs
from ._rules import cat_rule, split_rule
from ._strategy import Sets, Strategy, dedup, rule

__all__ = [
    "Window",
    "window_of",
    "halo_pieces",
    "flip_pieces",
    "halo_bytes",
    "conv_windows",
    "concat_windows",
    "unfold_windows",
]

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Window:
    """Output row j along ``dim`` is input row ``j + offset`` when ``0 <= j + offset < size_in``,
    else ``fill``; a rank with output rows a .. b reads input rows a + offset .. b + offset + extra."""

    dim: int
    size_in: int
    size_out: int
    offset: int
    fill: float | int | bool = 0
    extra: int = 0  # rows each rank reads past its last output row's (a convolution's kernel reach)


def _bound(i, size: int, default: int) -> int:
    """A slice bound as torch normalizes it: None is the default, negatives count from the end,
    then clamped to the dim."""
    if i is None:
        return default
    if not isinstance(i, torch.SymInt):
        i = int(i)
    return min(max(i + size if i < 0 else i, 0), size)


def _slice_args(args, ndim: int):
    """(dim, start, end, step) of a ``slice.Tensor`` call's arguments after its input, defaults
    filled in."""
    full = list(args) + [0, None, None, 1][len(args) :]
    return full[0] % ndim, full[1], full[2], full[3]


def window_of(node: fx.Node) -> Window | None:
    """The window a slice, slice gradient or constant pad is along its one moved dim; None when it
    is none (a strided slice, a pad of several dims: the caller blocks them as before)."""
    op = node.target
    if op is aten.slice.Tensor:
        x = out_vals(node.args[0])[0]
        dim, start, end, step = _slice_args(fx.node.map_arg(node.args[1:], lambda a: a.meta["val"]), x.ndim)
        size = x.shape[dim]
        if step not in (None, 1):
            return None
        a = _bound(start, size, 0)
        return Window(dim, size, max(_bound(end, size, size) - a, 0), a)
    if op is aten.slice_backward.default:
        # a symbolic graph's sizes and bounds are nodes: their values (SymInts, unguarded)
        sizes, dim, start, end, step = fx.node.map_arg(node.args[1:6], lambda a: a.meta["val"])
        dim %= len(sizes)
        if step != 1:
            return None
        size = sizes[dim]
        return Window(dim, out_vals(node.args[0])[0].shape[dim], size, -_bound(start, size, 0))
    if op is aten.constant_pad_nd.default:
        # a pad to a multiple of a chunk, ``(-s) % 16``, is a node on a symbolic length: its value
        x, pad = out_vals(node.args[0])[0], fx.node.map_arg(node.args[1], lambda a: a.meta["val"])
        moved = [x.ndim - 1 - i // 2 for i in range(len(pad)) if not statically_known_true(pad[i] == 0)]
        if len(set(moved)) != 1:
            return None
        dim = moved[0]
        i = 2 * (x.ndim - 1 - dim)
        left, right = pad[i], pad[i + 1]
        value = node.args[2] if len(node.args) > 2 else 0
        return Window(dim, x.shape[dim], x.shape[dim] + left + right, -left, value)
    return None


def _pieces(size_in: int, size_out: int, n: int, reads, *sizes) -> list[tuple[int, int, int, int]]:
    """(source rank, destination rank, first input row, rows) of every piece of the input a rank
    needs for its output rows, in destination then source order (increasing rows); a rank's own
    rows are pieces too (source == destination). ``reads(num, first, rows)``: the input rows
    [lo, hi) a rank's output rows read, in the arithmetic ``num`` (``_lengths.arithmetic`` of the
    sizes, ``sizes``: any other the reads use). On a symbolic length the bounds are clamped by
    which is smaller from some length on (the compile guarded to it), so a piece's size is a plain
    expression of the length, no ``Min``/``Max``, and a piece is dropped only where it is empty
    at every length the compile runs (a piece empty at some is kept, an empty slice there)."""
    num = arithmetic(size_in, size_out, *sizes, n=n)
    size_in_ = num.size(size_in)
    ci, co = [num.size(c) for c in chunks(size_in, n)], [num.size(c) for c in chunks(size_out, n)]
    ia, oa = offsets(ci), offsets(co)
    pieces = []
    for q in range(n):
        if num.empty(co[q]):
            continue
        lo, hi = reads(num, oa[q], co[q])
        lo, hi = num.greatest(lo, 0), num.least(hi, size_in_)
        for r in range(n):  # source: input rows ia[r] .. ia[r] + ci[r]
            end = ia[r] + ci[r]
            a = num.least(num.greatest(lo, ia[r]), end)
            rows = num.greatest(num.least(hi, end) - a, 0)
            if not num.empty(rows):
                pieces.append((r, q, a, rows))
    num.guard()
    return [(r, q, num.value(a), num.value(rows)) for r, q, a, rows in pieces]


def halo_pieces(w: Window, n: int) -> list[tuple[int, int, int, int]]:
    """The pieces (``_pieces``) of window ``w``: output rows a .. b read a + offset .. b + offset
    + extra."""

    def reads(num, a, k):
        offset = num.size(w.offset)
        # a rank with no output rows reads nothing, not the ``extra`` past them
        return a + offset, a + k + offset + num.least(k, 1) * w.extra

    return _pieces(w.size_in, w.size_out, n, reads, w.offset)


def flip_pieces(size: int, n: int) -> list[tuple[int, int, int, int]]:
    """The pieces (``_pieces``) of a flip along a dim of ``size``: output row j is input row
    size - 1 - j, so a rank's rows come, reversed, from the mirrored ranks."""

    def reads(num, a, k):
        s = num.size(size)
        return s - a - k, s - a

    return _pieces(size, size, n, reads)


def _row_bytes(v, dim: int) -> float:
    """Bytes of one row of ``v`` along ``dim``."""
    return v.element_size() * v.numel() / max(v.shape[dim], 1)


def sent_bytes(pieces, n: int, row_bytes: float) -> float:
    """Bytes the busiest rank sends to the others (rows of ``row_bytes``)."""
    sent = [0] * n
    for r, q, _, rows in pieces:
        if r != q:
            sent[r] += hint(rows)  # a cost: at the length the compile was first called with
    return max(sent) * row_bytes


def halo_bytes(w: Window, n: int, row_bytes: float) -> float:
    """Bytes the busiest rank sends to the others for window ``w``."""
    return sent_bytes(halo_pieces(w, n), n, row_bytes)


def _window_rule(node: fx.Node, A: Sets, n: int, *, linear: bool) -> list[Strategy]:
    """The op on a replicated or (when linear) partial input as it is, sharded along any dim it
    leaves alone, and sharded along the dim it moves as a halo exchange."""
    x = out_vals(node.args[0])[0]
    w = window_of(node)
    if w is None:
        moved = _moved_dims(node, x.ndim)
    else:
        moved = set() if (w.offset == 0 and w.size_in == w.size_out) else {w.dim}  # a whole dim kept
    res = [Strategy((R,), (R,))]
    if linear and P in A[0]:
        res.append(Strategy((P,), (P,)))
    for d, sf in shard_specs(A[0]):
        if d not in moved:
            res.append(Strategy((shard(d, sf),), (shard(d, sf),)))
        elif w is not None and sf == 1 and w.size_out > 0 and (x.is_floating_point() or x.is_complex()):
            # integer and bool data (labels, masks, positions) are bookkeeping, replicated cheaply
            comm = halo_bytes(w, n, _row_bytes(x, d))
            res.append(Strategy((shard(d),), (shard(d),), kernel=Kernel.HALO, comm=comm))
    return dedup(res)


def _moved_dims(node: fx.Node, ndim: int) -> set[int]:
    """The dims a slice, slice gradient or pad that is no window changes."""
    if node.target is aten.slice.Tensor:
        return {_slice_args(node.args[1:], ndim)[0]}
    if node.target is aten.slice_backward.default:
        return {node.args[2] % ndim}
    pad = node.args[1]
    return {ndim - 1 - i // 2 for i in range(len(pad)) if pad[i] != 0}


@rule(aten.slice.Tensor, aten.slice_backward.default)
def _slice(node, A, n):
    return _window_rule(node, A, n, linear=True)


@rule(aten.constant_pad_nd.default)
def _pad(node, A, n):
    value = node.args[2] if len(node.args) > 2 else 0
    return _window_rule(node, A, n, linear=value == 0)


# ---------------------------------------------------------------------------------------------
# convolutions along the sequence: a 1-d convolution of (batch, channels, sequence), stride 1


def _conv_geometry(node: fx.Node, x_arg: int) -> tuple[int, int, int, int] | None:
    """(input length, output length, padding, reach) of a 1-d, stride-1, untransposed
    convolution or its backward; reach = dilation * (kernel - 1). None for any other."""
    a = node.args
    x, w = out_vals(a[x_arg])[0], out_vals(a[x_arg + 1])[0]
    stride, padding, dilation, transposed = a[x_arg + 3 : x_arg + 7]
    if x.ndim != 3 or transposed or list(stride) != [1] or len(padding) != 1 or len(dilation) != 1:
        return None
    reach = dilation[0] * (w.shape[2] - 1)
    size_in = x.shape[2]
    return size_in, size_in + 2 * padding[0] - reach, padding[0], reach


def conv_windows(node: fx.Node) -> tuple[Window, Window] | None:
    """(input rows each rank's output rows read; output-gradient rows each rank's input rows'
    gradient reads) of a 1-d convolution (or its backward) sharded along the sequence (dim 2)."""
    g = _conv_geometry(node, 1 if node.target is aten.convolution_backward.default else 0)
    if g is None:
        return None
    size_in, size_out, pad, reach = g
    return Window(2, size_in, size_out, -pad, extra=reach), Window(2, size_out, size_in, pad - reach, extra=reach)


@rule(aten.convolution.default)
def _convolution(node, A, n):
    """Replicated; split over the batch; or split along the sequence, each rank reading the
    ``reach`` rows past its own (and the padding's) from its neighbours."""
    k = len(A)
    res = [Strategy((R,), (R,) * k)]
    x = out_vals(node.args[0])[0]
    if shard(0) in A[0]:
        res.append(Strategy((shard(0),), (shard(0),) + (R,) * (k - 1)))
    ws = conv_windows(node)
    if ws is not None and shard(2) in A[0] and ws[0].size_out > 0:
        comm = halo_bytes(ws[0], n, _row_bytes(x, 2))
        res.append(Strategy((shard(2),), (shard(2),) + (R,) * (k - 1), kernel=Kernel.HALO, comm=comm))
    return res


@rule(aten.convolution_backward.default)
def _convolution_bwd(node, A, n):
    """The convolution's gradients: the input's placed as the input, the weight's and bias's
    partial sums when the input is split."""
    mask = node.args[10]

    def outs(first, rest):
        return tuple(p if m else None for p, m in zip((first, rest, rest), mask))

    res = [Strategy(outs(R, R), (R, R, R))]
    if shard(0) in A[0] and shard(0) in A[1]:
        res.append(Strategy(outs(shard(0), P), (shard(0), shard(0), R)))
    ws = conv_windows(node)
    if ws is not None and shard(2) in A[0] and shard(2) in A[1]:
        x, g = out_vals(node.args[1])[0], out_vals(node.args[0])[0]
        comm = (halo_bytes(ws[0], n, _row_bytes(x, 2)) if mask[1] or mask[2] else 0.0) + (
            halo_bytes(ws[1], n, _row_bytes(g, 2)) if mask[0] else 0.0
        )
        res.append(Strategy(outs(shard(2), P), (shard(2), shard(2), R), kernel=Kernel.HALO, comm=comm))
    return res


# ---------------------------------------------------------------------------------------------
# sliding windows along the sequence: ``x.unfold(dim, size, 1)`` (a local attention's or a
# convolution's windows, written by hand)


def unfold_windows(node: fx.Node) -> tuple[int, int, Window, Window] | None:
    """(dim, window size, input rows each rank's windows read, window-gradient rows each rank's
    input rows' gradient reads) of an unfold with step 1 or its backward; None for other steps."""
    if node.target is aten.unfold.default:
        x = out_vals(node.args[0])[0]
        dim, size, step = node.args[1:4]
        dim %= max(x.ndim, 1)
        length = x.shape[dim]
    else:
        # a symbolic graph's sizes are nodes: their values (SymInts, unguarded)
        sizes, dim, size, step = fx.node.map_arg(node.args[1:5], lambda a: a.meta["val"])
        dim %= max(len(sizes), 1)
        length = sizes[dim]
    if step != 1 or size > length:
        return None
    m = length - size + 1
    return dim, size, Window(dim, length, m, 0, extra=size - 1), Window(dim, m, length, 1 - size, extra=size - 1)


@rule(aten.unfold.default, aten.unfold_backward.default)
def _unfold(node, A, n):
    """Replicated or partial (linear); sharded along any other dim (the windows' own dim is new
    and last); or along the unfolded dim with step 1, each rank reading the ``size - 1`` rows
    past its own (forward) or before them (backward) from its neighbours."""
    fwd = node.target is aten.unfold.default
    src = out_vals(node.args[0])[0]
    uw = unfold_windows(node)
    dim = (node.args[1] if fwd else node.args[2]) % max(src.ndim - (0 if fwd else 1), 1)
    res = [Strategy((R,), (R,))]
    if P in A[0]:
        res.append(Strategy((P,), (P,)))
    for d, sf in shard_specs(A[0]):
        if d != dim and d < src.ndim - (0 if fwd else 1):
            res.append(Strategy((shard(d, sf),), (shard(d, sf),)))
        elif d == dim and sf == 1 and uw is not None and uw[2].size_out > 0 and _float(src):
            w = uw[2] if fwd else uw[3]
            comm = halo_bytes(w, n, _row_bytes(src, d))
            res.append(Strategy((shard(d),), (shard(d),), kernel=Kernel.HALO, comm=comm))
    return dedup(res)


# ---------------------------------------------------------------------------------------------
# pieces put together along the sequence: cat (of shifted pieces: ``cat([zeros, x[:, :-1]], 1)``,
# RWKV's token shift) and roll


def concat_windows(node: fx.Node) -> tuple[int, list[Window], tuple] | None:
    """(dim, one window per piece, (shifts, dims) of a roll along other dims) of a cat of pieces
    along ``dim`` or a roll along it: a rank's output rows are, in order, the rows each window
    reads (without its fill). A roll of r is ``cat([x[L - r:], x[:L - r]])``. None for others."""
    out = out_vals(node)[0]
    if node.target is aten.cat.default:
        dim = (node.args[1] if len(node.args) > 1 else 0) % out.ndim
        vals = [out_vals(u)[0] for u in node.args[0]]
        if any(v.ndim != out.ndim for v in vals):
            return None
        starts = offsets([v.shape[dim] for v in vals])
        return dim, [Window(dim, v.shape[dim], out.shape[dim], -a) for v, a in zip(vals, starts)], ((), ())
    shifts, dims = list(node.args[1]), list(node.args[2]) if len(node.args) > 2 else []
    if not dims or len(dims) != len(shifts):
        return None  # a roll of the flattened tensor
    dims = [d % out.ndim for d in dims]
    return dims[0], _roll_windows(dims[0], out.shape[dims[0]], shifts[0]), (tuple(shifts[1:]), tuple(dims[1:]))


def _roll_windows(dim: int, size: int, shift: int) -> list[Window]:
    r = shift % size if size else 0
    return [Window(dim, size, size, size - r), Window(dim, size, size, -r)]


def _float(v) -> bool:
    return v.is_floating_point() or v.is_complex()


def _pieces_strategy(node: fx.Node, A: Sets, n: int, dim: int, ws: list[Window], k: int) -> Strategy | None:
    """Every piece split along ``dim`` (a replicated one sliced for free), the output too, each
    rank gathering its rows from the pieces' holders: floating-point data only (integer and bool
    bookkeeping stays replicated)."""
    vals = [out_vals(u)[i] for u, i in tensor_inputs(node)]
    s = shard(dim)
    if not (any(s in a for a in A) and all(s in a or R in a for a in A) and all(map(_float, vals))):
        return None
    vals = vals if len(vals) == len(ws) else vals * len(ws)  # a roll: two windows of one input
    comm = sum(halo_bytes(w, n, _row_bytes(v, dim)) for w, v in zip(ws, vals))
    return Strategy((s,), (s,) * k, kernel=Kernel.HALO, comm=comm)


@rule(aten.cat.default)
def _cat(node, A, n):
    res = cat_rule(node, A, n)
    cw = concat_windows(node)
    if cw is not None and len(cw[1]) > 1:
        st = _pieces_strategy(node, A, n, cw[0], cw[1], len(A))
        if st is not None:
            res = dedup([*res, st])
    return res


def split_windows(node: fx.Node) -> tuple[int, list[Window]] | None:
    """(dim, one window per output) of a split: output i is the input's rows a_i .. a_i + k_i."""
    if node.target not in (aten.split.Tensor, aten.split_with_sizes.default):
        return None
    x = out_vals(node.args[0])[0]
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % x.ndim
    sizes = [v.shape[dim] for v in out_vals(node)]
    return dim, [Window(dim, x.shape[dim], k, a) for k, a in zip(sizes, offsets(sizes))]


# Several windows of a split along the sequence, each sharded in its own right: off. litgpt's
# chunked loss in 16-row chunks at 37 tokens on 2 ranks gave a loss 3e-3 from one device's on a
# symbolic length, and per-rank collective counts that differ on a static one (refused); at 64
# tokens exact. Until the windows' exchange is right at uneven lengths, such a split gathers (a
# loss in chunks of rows, as litgpt's, never reaches it: ``backend._unchunk`` runs it as one).
SPLIT_WINDOWS = False


@rule(aten.split.Tensor, aten.split_with_sizes.default)
def _split(node, A, n):
    """Along any dim it does not split (``split_rule``); along the sharded dim, each output a
    window of the input's rows, sharded over the ranks in its own right: one output is the input
    (litgpt's ``chunked_cross_entropy`` with chunks longer than the sequence); several would exchange
    the rows each rank's share of each output reads (``SPLIT_WINDOWS``: off, wrong at uneven
    lengths), and gather the input meanwhile."""
    res = split_rule(node, A, n)
    dim, ws = split_windows(node)
    x = out_vals(node.args[0])[0]
    for d, sf in shard_specs(A[0]):
        if d != dim or sf != 1:
            continue
        if len(ws) == 1:
            res.append(Strategy((shard(d),), (shard(d),)))
        elif _float(x) and SPLIT_WINDOWS:
            comm = sum(halo_bytes(w, n, _row_bytes(x, d)) for w in ws)
            res.append(Strategy((shard(d),) * len(ws), (shard(d),), kernel=Kernel.HALO, comm=comm))
    return dedup(res)


@rule(aten.roll.default)
def _roll(node, A, n):
    """Replicated; sharded along a dim it does not roll; or along the first dim it rolls, the
    rows each rank needs exchanged (the other dims' rolls then run locally)."""
    nd = out_vals(node)[0].ndim
    dims = [d % nd for d in (node.args[2] if len(node.args) > 2 else [])]
    res = [Strategy((R,), (R,))]
    for d, sf in shard_specs(A[0]):
        if dims and d not in dims:
            res.append(Strategy((shard(d, sf),), (shard(d, sf),)))
    cw = concat_windows(node)
    if cw is not None and len(set(dims)) == len(dims):
        st = _pieces_strategy(node, A, n, cw[0], cw[1], 1)
        if st is not None:
            res.append(st)
    return dedup(res)


@rule(aten.flip.default)
def _flip(node, A, n):
    """Replicated, or sharded along a dim it does not flip (a reverse cumulative sum within
    chunks); or along one it flips, each rank receiving its rows from the mirrored ranks (one
    all-to-all of about the rank's rows: a scan's backward flips along the sequence twice)."""
    x = out_vals(node)[0]
    dims = {d % x.ndim for d in node.args[1]}
    res = [Strategy((R,), (R,))]
    if P in A[0]:
        res.append(Strategy((P,), (P,)))
    for d, sf in shard_specs(A[0]):
        if d not in dims:
            res.append(Strategy((shard(d, sf),), (shard(d, sf),)))
        elif sf == 1 and _float(x):
            comm = sent_bytes(flip_pieces(x.shape[d], n), n, _row_bytes(x, d))
            res.append(Strategy((shard(d),), (shard(d),), kernel=Kernel.HALO, comm=comm))
    return dedup(res)
