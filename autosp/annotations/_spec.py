"""Sharding specs: the einops-style grammar ("b s@sp d") and ``autosp.annotate``, which carries a
spec into the captured graph (as ``autosp::annotate``, ``propagate._annotate``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..propagate._annotate import annotate_placement

__all__ = ["parse_spec", "annotate"]

_AXIS = "sp"


def parse_spec(spec: str | Placement | Sequence[Placement], ndim: int) -> Placement:
    """A spec for a tensor of ``ndim`` dims -> its placement on the sp axis.

    ``"b s@sp d"`` names each dim and marks the one sharded over mesh axis "sp" (einops style);
    ``"b s d"`` is replicated; ``"..."`` may stand for leading dims. A DTensor placement (or a
    one-element list of them, one per mesh dim) is taken as is.
    """
    if isinstance(spec, Placement):
        return spec
    if not isinstance(spec, str):
        spec = list(spec)
        if len(spec) != 1 or not isinstance(spec[0], Placement):
            raise ValueError(f"autosp: annotate expects one placement for the sp axis, got {spec!r}")
        return spec[0]
    tokens = spec.split()
    if "..." in tokens:
        i = tokens.index("...")
        tokens = tokens[:i] + ["_"] * (ndim - len(tokens) + 1) + tokens[i + 1 :]
    if len(tokens) != ndim:
        raise ValueError(
            f"autosp: spec {spec!r} names {len(tokens)} dims but the tensor has {ndim}; "
            f"write one name per dim, e.g. 'b s@sp d'"
        )
    sharded = [i for i, t in enumerate(tokens) if "@" in t]
    for i in sharded:
        axis = tokens[i].split("@", 1)[1]
        if axis != _AXIS:
            raise ValueError(f"autosp: spec {spec!r} shards over mesh axis {axis!r}; only 'sp' is supported")
    if len(sharded) > 1:
        raise ValueError(f"autosp: spec {spec!r} shards {len(sharded)} dims over 'sp'; shard one dim")
    return Shard(sharded[0]) if sharded else Replicate()


def annotate(x: torch.Tensor, spec, *, hard: bool = True) -> torch.Tensor:
    """Constrain the placement of ``x`` on the sp axis (JAX's ``with_sharding_constraint``).

    ``spec`` is einops-style (``"b s@sp d"``) or a DTensor placement. Outside an autosp capture it
    returns a copy of ``x``. With ``hard=False`` the spec is a permission, not a constraint: the
    planner may keep ``x`` replicated (how ``autosp.shard`` marks its inputs).
    """
    return annotate_placement(x, parse_spec(spec, x.ndim), hard)
