"""The per-rank call of a scatter along the sharded dim (``Kernel.OWN_ROWS``): the index holds
global rows, whole on every rank, and each rank writes only the entries that land in its own
rows. An entry for another rank's row goes to one spare row past this rank's, dropped after the
write, so the op runs unchanged (``scatter``, ``scatter_add``: its semantics on ties included)."""

from __future__ import annotations

import functools

import torch

from .._context import Kernel
from .._graph import out_vals
from ..propagate._placement import chunk, chunk_start, shard_spec

__all__ = ["OWN_ROWS_KERNELS", "block_rows"]


def block_rows(nd, s, n: int, rank: int) -> tuple[int, int, int, int]:
    """(block, split factor, rows, first row) of the input ``nd`` reads sharded (``s.ins[0]``):
    its sharded dim is ``sf`` blocks of ``block`` global rows, of each of which this rank holds
    ``rows`` from ``first`` on."""
    d, sf = shard_spec(s.ins[0])
    block = out_vals(nd.args[0])[0].shape[d] // sf
    return block, sf, chunk(block, n, rank), chunk_start(block, n, rank)


def _own_rows(op, x, dim, index, *rest, rows: tuple[int, int, int, int], **kwargs):
    d = dim % x.ndim
    block, sf, c, off = rows
    within = index % block - off
    local = torch.where((within >= 0) & (within < c), index // block * c + within, sf * c)
    spare = list(x.shape)
    spare[d] = 1
    out = op(torch.cat([x, x.new_zeros(spare)], d), d, local, *rest, **kwargs)
    return out.narrow(d, 0, sf * c)


def _own_rows_call(nd, s, target, args, kwargs, ctx):
    return functools.partial(_own_rows, target, rows=block_rows(nd, s, ctx.n, ctx.rank)), args, kwargs


OWN_ROWS_KERNELS = {Kernel.OWN_ROWS: _own_rows_call}
