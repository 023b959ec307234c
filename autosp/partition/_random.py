"""Dropout on a sequence shard: each rank draws its own shard's mask.

Every rank starts a step with the same default-generator state (the user seeds them alike, or
the model would differ). Plain ``native_dropout`` on each rank's shard would then draw the same
mask pattern on every shard. ``autosp::dropout`` draws one 63-bit seed from the default
generator (the same on every rank, so the generator stays in step across ranks) and draws the
mask from a private generator seeded with (that seed, rank). Results are reproducible for a
given seed and sp size, but are not the single-device masks: see the README.
"""

from __future__ import annotations

import torch

from ..propagate._placement import is_shard

__all__ = ["sharded_dropout", "dropout_call"]

_SALT = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): spreads ranks' seeds apart


@torch.library.custom_op("autosp::dropout", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _dropout_op(x: torch.Tensor, p: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    seed = int(torch.empty((), dtype=torch.int64).random_(0, 2**62).item())
    g = torch.Generator(device=x.device).manual_seed((seed + rank * _SALT) % 2**63)
    mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p, generator=g)
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    return x * mask * scale, mask


@_dropout_op.register_fake
def _(x, p, rank):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def sharded_dropout(x: torch.Tensor, p: float, train: bool | None, rank: int):
    if not train or p == 0.0:
        return torch.ops.aten.native_dropout.default(x, p, train)
    return torch.ops.autosp.dropout(x, p, rank)


def dropout_call(nd, s, target, args, kwargs, ctx):
    """The per-rank call of ``native_dropout``: on a sharded input, this rank's own draws."""
    if not any(is_shard(q) for q in s.ins):
        return target, args, kwargs
    kwargs = dict(kwargs)
    train = args[2] if len(args) > 2 else kwargs.pop("train", None)
    return sharded_dropout, (args[0], args[1], train, ctx.rank), kwargs
