"""Sharding specs: the einops-style grammar ("b s@sp d"), DTensor placements, and the
``autosp::annotate`` op that carries a spec into the captured graph."""
from __future__ import annotations

import re
from typing import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = ["parse_spec", "parse_placement", "placement_str", "annotate"]

_AXIS = "sp"


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
        tokens = tokens[:i] + ["_"] * (ndim - len(tokens) + 1) + tokens[i + 1:]
    if len(tokens) != ndim:
        raise ValueError(f"autosp: spec {spec!r} names {len(tokens)} dims but the tensor has {ndim}; "
                         f"write one name per dim, e.g. 'b s@sp d'")
    sharded = [i for i, t in enumerate(tokens) if "@" in t]
    for i in sharded:
        axis = tokens[i].split("@", 1)[1]
        if axis != _AXIS:
            raise ValueError(f"autosp: spec {spec!r} shards over mesh axis {axis!r}; only 'sp' is supported")
    if len(sharded) > 1:
        raise ValueError(f"autosp: spec {spec!r} shards {len(sharded)} dims over 'sp'; shard one dim")
    return Shard(sharded[0]) if sharded else Replicate()


@torch.library.custom_op("autosp::annotate", mutates_args=())
def _annotate_op(x: torch.Tensor, placement: str, hard: bool) -> torch.Tensor:
    return x.clone()


@_annotate_op.register_fake
def _(x, placement, hard):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.placement, ctx.hard = inputs[1], inputs[2]


def _backward(ctx, grad):
    # JAX's with_sharding_constraint transposes to the same constraint on the cotangent.
    return torch.ops.autosp.annotate(grad, ctx.placement, ctx.hard), None, None


_annotate_op.register_autograd(_backward, setup_context=_setup)


def annotate(x: torch.Tensor, spec, *, hard: bool = True) -> torch.Tensor:
    """Constrain the placement of ``x`` on the sp axis (JAX's ``with_sharding_constraint``).

    ``spec`` is einops-style (``"b s@sp d"``) or a DTensor placement. Outside an autosp capture it
    returns a copy of ``x``. With ``hard=False`` the spec is a permission, not a constraint: the
    planner may keep ``x`` replicated (how ``autosp.shard`` marks its inputs).
    """
    p = parse_spec(spec, x.ndim)
    return torch.ops.autosp.annotate(x, placement_str(p), hard)
