"""The per-rank call of a reduction whose per-rank results merge by a formula
(``Kernel.MERGE``), each rank's results all-gathered (reduced-sized, never the input): a
log-sum-exp along the sharded dim is merged by a log-sum-exp over the ranks (a rank without
elements contributes -inf, which the merge ignores); a variance or standard deviation by Chan's
formula from each rank's (count, mean, sum of squared deviations)."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed._functional_collectives as funcol

from .._context import Kernel

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


def _merge_call(nd, s, target, args, kwargs, ctx):
    """(call, args, kwargs) of a reduction run as a merge of the ranks' results."""
    common = dict(n=ctx.n, group=ctx.group)
    if target is torch.ops.aten.logsumexp.default:
        return functools.partial(_logsumexp, **common), args, kwargs
    std = target is torch.ops.aten.std.correction
    return functools.partial(_variance, std=std, **common), args, kwargs


MERGE_KERNELS = {Kernel.MERGE: _merge_call}
