"""The per-rank call of a reduction whose per-rank results merge by a formula
(``Kernel.MERGE``), each rank's results all-gathered (reduced-sized, never the input): a
log-sum-exp along the sharded dim is merged by a log-sum-exp over the ranks (a rank without
elements contributes -inf, which the merge ignores); a variance or standard deviation by Chan's
formula from each rank's (count, mean, sum of squared deviations); a product by a product; a
running sum, product or log-sum-exp (``cumsum``, ``cumprod``, ``logcumsumexp``) from the totals
of the ranks before; a maximum or minimum along the
dim with its index (``max(dim)``, ``argmax``) from each rank's (value, global index), the first
index winning ties as on one device."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed._functional_collectives as funcol

from .._context import Kernel
from ._scatter import block_rows

__all__ = ["MERGE_KERNELS"]


def _logsumexp(x, dim, keepdim=False, *, n, group):
    dims = _dims(x, dim)
    own = torch.logsumexp(x, dims, keepdim=True)
    every = funcol.all_gather_tensor(own.contiguous(), 0, group).reshape(n, *own.shape)
    out = torch.logsumexp(every, 0)
    return out if keepdim else out.squeeze(dims)


def _dims(x, dim) -> list[int]:
    return [d % x.ndim for d in ([dim] if isinstance(dim, int) else dim or [])] or list(range(x.ndim))


def _variance(x, dim=None, *, correction=None, keepdim=False, std: bool, n: int, group):
    """Chan's merge: from each rank's count, mean and sum of squared deviations (a rank without
    elements counts zero), the global mean's squared deviations, over count - correction."""
    dims = _dims(x, dim)
    count = math.prod(x.shape[d] for d in dims)
    mean = x.mean(dims, keepdim=True) if count else x.sum(dims, keepdim=True)  # zeros without elements
    m2 = (x - mean).square().sum(dims, keepdim=True)
    own = torch.stack([torch.full_like(mean, count), mean, m2])
    every = funcol.all_gather_tensor(own.contiguous(), 0, group).reshape(n, *own.shape)
    counts, means, m2s = every.unbind(1)
    total = counts.sum(0)
    mu = (counts * means).sum(0) / total
    var = (m2s + counts * (means - mu).square()).sum(0) / (total - (1 if correction is None else correction))
    out = var.sqrt() if std else var
    return out if keepdim else out.squeeze(dims)


def _extremum_at(x, dim, keepdim=False, *, largest: bool, values: bool, rows, n: int, group):
    """``max(x, dim)`` (``values``) or ``argmax(x, dim)`` (``largest``; else min / argmin) of the
    global tensor, from this rank's rows (``block_rows``): each rank's extremum and its global
    index (a rank without rows offers none), gathered; the extremum of those, and of its holders
    the least index (NaN wins, as on one device)."""
    d = dim % x.ndim
    block, sf, c, off = rows
    if x.shape[d]:
        v, i = (torch.max if largest else torch.min)(x, d, keepdim=True)
        i = i // c * block + off + i % c
    else:  # none, computed from x: an exchange of constants alone would be traced out on this rank
        v = x.sum(d, keepdim=True) + (-math.inf if largest else math.inf)
        i = v.new_zeros(v.shape, dtype=torch.long) + sf * block  # past every real index
    vs = funcol.all_gather_tensor(v.contiguous(), 0, group).reshape(n, *v.shape)
    idx = funcol.all_gather_tensor(i.contiguous(), 0, group).reshape(n, *i.shape)
    best = vs.amax(0) if largest else vs.amin(0)  # NaN propagates, as max does
    held = (vs == best) | (vs.isnan() & best.isnan())
    i = torch.where(held, idx, sf * block).amin(0)
    if not keepdim:
        best, i = best.squeeze(d), i.squeeze(d)
    return (best, i) if values else i


def _scan(x, dim, *, kind: str, rank: int, n: int, group, **kwargs):
    """``cumsum``, ``cumprod`` or ``logcumsumexp`` (``kind``: "sum", "prod", "log") along the
    sharded dim: this rank's running result over its rows, combined with the totals of the ranks
    before it (every rank's last row, gathered)."""
    d = dim % x.ndim
    scan, total, combine, none = _SCAN_KINDS[kind]
    y = scan(x, d, **kwargs)
    if y.shape[d]:
        last = y.narrow(d, y.shape[d] - 1, 1)
    else:  # none, computed from y: an exchange of constants alone would be traced out on this rank
        last = y.sum(d, keepdim=True) + none
    every = funcol.all_gather_tensor(last.contiguous(), 0, group).reshape(n, *last.shape)[:rank]
    return combine(y, total(every, 0))


# kind -> (the scan, the total of the ranks' totals, the combination, a rank's total without rows)
_SCAN_KINDS = {
    "sum": (torch.cumsum, torch.sum, torch.add, 0.0),
    "prod": (torch.cumprod, torch.prod, torch.mul, 1.0),
    "log": (torch.logcumsumexp, torch.logsumexp, torch.logaddexp, -math.inf),
}
_SCANS = {
    torch.ops.aten.cumsum.default: "sum",
    torch.ops.aten.cumprod.default: "prod",
    torch.ops.aten.logcumsumexp.default: "log",
}


def _prod(x, dim, keepdim=False, *, n: int, group, **kwargs):
    """A product along the sharded dim: the product of the ranks' own (a rank without elements
    gives 1)."""
    d = dim % x.ndim
    own = x.prod(d, keepdim=True, **kwargs)
    out = funcol.all_gather_tensor(own.contiguous(), 0, group).reshape(n, *own.shape).prod(0)
    return out if keepdim else out.squeeze(d)


_EXTREMA = {
    torch.ops.aten.max.dim: (True, True),
    torch.ops.aten.min.dim: (False, True),
    torch.ops.aten.argmax.default: (True, False),
    torch.ops.aten.argmin.default: (False, False),
}


def _merge_call(nd, s, target, args, kwargs, ctx):
    """(call, args, kwargs) of a reduction run as a merge of the ranks' results."""
    common = dict(n=ctx.n, group=ctx.group)
    if target in _SCANS:
        return functools.partial(_scan, kind=_SCANS[target], rank=ctx.rank, **common), args, kwargs
    if target is torch.ops.aten.prod.dim_int:
        return functools.partial(_prod, **common), args, kwargs
    if target in _EXTREMA:
        largest, values = _EXTREMA[target]
        rows = block_rows(nd, s, ctx.n, ctx.rank)
        return functools.partial(_extremum_at, largest=largest, values=values, rows=rows, **common), args, kwargs
    if target is torch.ops.aten.logsumexp.default:
        return functools.partial(_logsumexp, **common), args, kwargs
    std = target is torch.ops.aten.std.correction
    return functools.partial(_variance, std=std, **common), args, kwargs


MERGE_KERNELS = {Kernel.MERGE: _merge_call}
