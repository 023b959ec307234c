"""The per-rank call of a shift along the sharded dim (``propagate._shift``): this rank's output
rows from its own input rows and the boundary rows its neighbours send, in one all-to-all that
carries only those rows (skipped on every rank when no rank needs another's rows), with the
window's fill where the output reads past the input."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .._context import Kernel
from .._graph import known_alike, out_vals, retraced
from .._lengths import arithmetic, plain
from ..propagate._placement import chunk, chunks, offsets, shard_spec
from ..propagate._shift import (
    Window,
    concat_windows,
    conv_windows,
    flip_pieces,
    halo_pieces,
    split_windows,
    unfold_windows,
    window_of,
)

__all__ = ["shifted", "window_rows", "HALO_KERNELS"]


def _narrow(x: torch.Tensor, d: int, start, rows) -> torch.Tensor:
    """``x.narrow(d, start, rows)`` of a piece, without guards on its bounds: the pieces lie in
    their source's rows at every length the compile admits (``_pieces``), and torch's shape env
    proved some such bounds only late, then stopped in them (torch 2.13: "AssertionError:
    Expected Lt/Le/Eq/Ne, got BooleanTrue", a reverse cumulative sum's flip on a length guarded
    even)."""
    sym = next((v for v in (*x.shape, start, rows) if isinstance(v, torch.SymInt)), None)
    with sym.node.shape_env.suppress_guards() if sym is not None else contextlib.nullcontext():
        out = x.narrow(d, plain(start), rows)
    got = out.shape[d]
    if isinstance(got, torch.SymInt) and free_unbacked_symbols(got.node.expr):
        # without guards torch's slice could not read the size and made a new (unbacked) symbol
        # of it: it is ``rows`` (the ops after it would stop in guards on that symbol: a reverse
        # running product's backward on rank 1 of 2 at 37 tokens)
        torch._check(got == rows)
    return out


def _rows(x: torch.Tensor, d: int, size_in: int, pieces, n: int, rank: int, group) -> list[torch.Tensor]:
    """The input rows this rank's output rows read (``pieces``, of an input of ``size_in`` rows
    along ``d``), in order, from ``x`` (its rows of the input) and from the other ranks (one
    all-to-all, when any rank needs another's rows). The exchange moves the rows along dim 0
    (``movedim``), never flattened: on a symbolic length a piece's size is a clamped expression
    of it (``Max(0, ...)``) that can be 0 at the compile's first length, and Inductor's lowering
    of a reshape of such a slice stops (torch 2.13: "IndexError: pop from empty list" in
    ``_dynamic_reshape_indexer``, a logits shift's backward on 2 ranks at 64 tokens)."""
    start = offsets(chunks(size_in, n))[rank]
    if not any(r != q for r, q, _, _ in pieces):
        return [_narrow(x, d, a - start, k) for r, q, a, k in pieces if q == rank]
    send = [(q, _narrow(x, d, a - start, k).movedim(d, 0)) for r, q, a, k in pieces if r == rank and q != rank]
    send_sizes, recv_sizes = [0] * n, [0] * n
    for q, t in send:
        send_sizes[q] = t.shape[0]
    for r, q, _, k in pieces:
        if q == rank and r != rank:
            recv_sizes[r] = k
    buf = torch.cat([t for _, t in send]) if send else x.narrow(d, 0, 0).movedim(d, 0).contiguous()
    y = funcol.all_to_all_single(buf, recv_sizes, send_sizes, group)
    got = {r: t.movedim(0, d) for r, t in enumerate(y.split(recv_sizes))}
    parts = [_narrow(x, d, a - start, k) if r == rank else got[r] for r, q, a, k in pieces if q == rank]
    if not any(q == rank and r != rank for r, q, _, _ in pieces):
        # the exchange's result must be read, or it is dead code on this rank only
        parts.append(y.narrow(0, 0, 0).movedim(0, d))
    return parts


def _real(fn):
    """``fn(x, ...)`` on a complex ``x`` as its (real, imaginary) pairs: gloo has no complex dtypes."""

    def run(x, *args):
        if x.is_complex():
            return torch.view_as_complex(fn(torch.view_as_real(x), *args).contiguous())
        return fn(x, *args)

    return run


@_real
def window_rows(x: torch.Tensor, w: Window, n: int, rank: int, group) -> torch.Tensor:
    """The input rows this rank's output rows of ``w`` read, without the fill (a piece of a cat)."""
    parts = _rows(x, w.dim, w.size_in, halo_pieces(w, n), n, rank, group) or [x.narrow(w.dim, 0, 0)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=w.dim)


@_real
def shifted(x: torch.Tensor, w: Window, n: int, rank: int, group) -> torch.Tensor:
    """This rank's output rows of window ``w``, from ``x``, its rows of the input."""
    d, shape = w.dim, list(x.shape)
    parts = _rows(x, d, w.size_in, halo_pieces(w, n), n, rank, group)
    num = arithmetic(w.size_out, w.offset, n=n)  # sizes clamped as the pieces are (``_pieces``)
    co = [num.size(c) for c in chunks(w.size_out, n)]
    size = co[rank]
    if w.extra:  # a rank with output rows reads ``extra`` past them
        size = size + num.least(size, 1) * w.extra
    first = offsets(co)[rank] + num.size(w.offset)  # the input row of this rank's first output row
    before = num.least(num.greatest(-first, 0), size)
    num.guard()
    size, before = num.value(size), num.value(before)
    after = size - before - sum(p.shape[d] for p in parts)

    def fill(rows):
        return x.new_full(shape[:d] + [rows] + shape[d + 1 :], w.fill)

    # on a symbolic length a fill is kept unless it is empty at every length (no guard on its size)
    parts = ([fill(before)] if _some(before) else []) + parts + ([fill(after)] if _some(after) else [])
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=d) if parts else fill(0)


def _some(rows) -> bool:
    """Whether ``rows`` may be more than none (at some length, for a symbolic one)."""
    return not known_alike(rows == 0)


def _identity(x):
    return x


@_real
def _flipped(x: torch.Tensor, d: int, size: int, n: int, rank: int, group) -> torch.Tensor:
    """This rank's rows of ``x`` flipped along ``d`` (of ``size`` rows): the mirrored rows, reversed."""
    parts = _rows(x, d, size, flip_pieces(size, n), n, rank, group) or [x.narrow(d, 0, 0)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)).flip(d)


def _flip(nd, s, x, dims, *, ctx):
    """A flip along the sharded dim (the strategy's), then along its other dims locally."""
    d = shard_spec(s.ins[0])[0]
    y = _flipped(x, d, retraced(out_vals(nd)[0].shape[d]), ctx.n, ctx.rank, ctx.group)
    rest = [e for e in dims if e % x.ndim != d]
    return y.flip(rest) if rest else y


def _at_least(t: torch.Tensor, rows: int, dim: int = 2) -> torch.Tensor:
    """``t`` with zero rows appended along ``dim`` up to ``rows``: the CPU convolution kernels
    (and unfold) refuse an input shorter than the kernel, which a rank with no rows of its own
    has. The result still reads ``t``, so a rank's exchange is never dead code there alone."""
    if t.shape[dim] >= rows:
        return t
    shape = list(t.shape)
    shape[dim] = rows - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _unfold(nd, x, dim, size, step, *, ctx):
    """This rank's windows: the unfold of its rows and the ``size - 1`` rows after them."""
    d, _, win, _ = unfold_windows(nd)
    rows = chunk(win.size_out, ctx.n, ctx.rank)
    xw = _at_least(shifted(x, win, ctx.n, ctx.rank, ctx.group), size, d)
    return xw.unfold(d, size, 1).narrow(d, 0, rows)


def _unfold_backward(nd, g, input_sizes, dim, size, step, *, ctx):
    """This rank's rows' gradient: from the windows that read them (the ``size - 1`` windows
    before its own too), the gradient of their unfold, of which the rows past the first
    ``size - 1`` are this rank's."""
    d, _, _, gwin = unfold_windows(nd)
    rows = chunk(gwin.size_out, ctx.n, ctx.rank)
    gg = _at_least(shifted(g, gwin, ctx.n, ctx.rank, ctx.group), 1, d)
    sizes = list(g.shape[:-1])
    sizes[d] = gg.shape[d] + size - 1
    gi = torch.ops.aten.unfold_backward.default(gg, sizes, d, size, 1)
    return gi.narrow(d, size - 1, rows)


def _convolution(nd, x, w, bias, stride, padding, dilation, transposed, output_padding, groups, *, ctx):
    """This rank's output rows: the convolution, unpadded, on the input rows they read."""
    win, _ = conv_windows(nd)
    rows = chunk(win.size_out, ctx.n, ctx.rank)
    reach = win.extra
    xw = _at_least(shifted(x, win, ctx.n, ctx.rank, ctx.group), reach + 1)
    y = torch.ops.aten.convolution.default(xw, w, bias, stride, [0], dilation, False, output_padding, groups)
    return y.narrow(2, 0, rows)


def _convolution_backward(
    nd, g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask, *, ctx
):
    """The weight's and bias's partial gradients from this rank's output rows and the input rows
    they read; the input's gradient for this rank's rows from the output-gradient rows that read
    them (the backward of an unpadded convolution over that window, of which the rows past the
    reach on either side are this rank's)."""
    win, gwin = conv_windows(nd)
    reach, n, rank, group = win.extra, ctx.n, ctx.rank, ctx.group
    bwd = torch.ops.aten.convolution_backward.default
    gi = gw = gb = None
    if mask[1] or mask[2]:
        g1 = _at_least(g, 1)
        xw = _at_least(shifted(x, win, n, rank, group), g1.shape[2] + reach)
        _, gw, gb = bwd(g1, xw, w, bias_sizes, stride, [0], dilation, False, [0], groups, [False, mask[1], mask[2]])
    if mask[0]:
        gg = _at_least(shifted(g, gwin, n, rank, group), 1)
        xz = x.new_zeros(*x.shape[:2], gg.shape[2] + reach)
        gi = bwd(gg, xz, w, bias_sizes, stride, [0], dilation, False, [0], groups, [True, False, False])[0]
        gi = gi.narrow(2, reach, x.shape[2])
    return gi, gw, gb


def _halo_call(nd, s, target, args, kwargs, ctx):
    """(call, args, kwargs) of an op run as a halo exchange: a slice, slice gradient or pad (the
    window is the op's whole result), a flip (the mirrored rows), a cat or roll (its pieces'
    rows, in order; a roll along other dims too runs locally after), a convolution or an
    unfold, or their backward, along the sequence."""
    if target is torch.ops.aten.convolution.default:
        return functools.partial(_convolution, nd, ctx=ctx), args, kwargs
    if target is torch.ops.aten.convolution_backward.default:
        return functools.partial(_convolution_backward, nd, ctx=ctx), args, kwargs
    if target is torch.ops.aten.flip.default:
        return functools.partial(_flip, nd, s, ctx=ctx), args, kwargs
    if target is torch.ops.aten.unfold.default:
        return functools.partial(_unfold, nd, ctx=ctx), args, kwargs
    if target is torch.ops.aten.unfold_backward.default:
        return functools.partial(_unfold_backward, nd, ctx=ctx), args, kwargs
    if target in (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default):
        with disable_proxy_modes_tracing():
            _, ws = split_windows(nd)
        ws = [_retraced_window(w) for w in ws]
        return _split_shifted, (args[0], ws, ctx), {}
    if target in (torch.ops.aten.cat.default, torch.ops.aten.roll.default):
        pieces = args[0] if target is torch.ops.aten.cat.default else [args[0]] * 2
        with disable_proxy_modes_tracing():
            dim, ws, rest = concat_windows(nd)
        ws = [_retraced_window(w) for w in ws]
        y = torch.cat([window_rows(x, w, ctx.n, ctx.rank, ctx.group) for x, w in zip(pieces, ws)], dim=dim)
        return (torch.roll, (y, *rest), {}) if rest[0] else (_identity, (y,), {})
    return _identity, (shifted(args[0], _traced_window(nd), ctx.n, ctx.rank, ctx.group),), {}


def _split_shifted(x, ws, ctx) -> list[torch.Tensor]:
    """This rank's rows of each output of a split along the sharded dim."""
    return [shifted(x, w, ctx.n, ctx.rank, ctx.group) for w in ws]


def _traced_window(nd) -> Window:
    """``window_of(nd)`` worked out on the global graph's sizes off the per-rank trace, then its
    sizes as values of that trace (``retraced``: a pad to a multiple of a chunk is an expression
    of the length)."""
    with disable_proxy_modes_tracing():
        w = window_of(nd)
    return _retraced_window(w)


def _retraced_window(w: Window) -> Window:
    sizes = {k: retraced(getattr(w, k)) for k in ("size_in", "size_out", "offset", "extra")}
    return dataclasses.replace(w, **sizes)


HALO_KERNELS = {Kernel.HALO: _halo_call}
