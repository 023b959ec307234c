"""The per-rank call of a reduction whose per-rank results merge by a formula
(``Kernel.MERGE``): a log-sum-exp along the sharded dim is each rank's log-sum-exp of its own
elements, all-gathered (reduced-sized, never the input) and merged by a log-sum-exp over the
ranks. A rank without elements contributes -inf, which the merge ignores."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from .._context import Kernel

__all__ = ["MERGE_KERNELS"]


def _logsumexp(x, dim, keepdim=False, *, n, group):
    dims = [d % x.ndim for d in ([dim] if isinstance(dim, int) else dim)] or list(range(x.ndim))
    own = torch.logsumexp(x, dims, keepdim=True)
    every = funcol.all_gather_tensor(own.contiguous(), 0, group).reshape(n, *own.shape)
    out = torch.logsumexp(every, 0)
    return out if keepdim else out.squeeze(dims)


def _merge_call(nd, s, target, args, kwargs, ctx):
    """(call, args, kwargs) of a reduction run as a merge of the ranks' results."""
    assert target is torch.ops.aten.logsumexp.default, target
    return (lambda *a, **k: _logsumexp(*a, **k, n=ctx.n, group=ctx.group)), args, kwargs


MERGE_KERNELS = {Kernel.MERGE: _merge_call}
