"""The step's outputs as one device returns them: every output replicated on every rank, each
parameter gradient summed over the sp ranks (a gradient ``Partial`` over sp) and, with dp > 1,
averaged over the dp replicas, as DDP does.

A gradient that is partial over sp is summed over sp and dp in one all-reduce on every rank,
then divided by dp; a replicated one is all-reduced over dp. Gradient all-reduces go in flat
buckets of up to 25 MiB (DDP's), one collective and one rank-to-rank sync per bucket instead of
per parameter. FSDP2's gradients leave ``autosp::fsdp_reduce`` already reduced into their shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement

from .._context import SpContext
from .._graph import out_vals
from ..propagate._placement import P, R
from ..propagate._strategy import Strategy
from ._collectives import redistribute
from ._fsdp import REDUCE

__all__ = ["Output", "output_specs", "place_outputs", "BUCKET_BYTES"]

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


@dataclass(frozen=True, slots=True)
class Output:
    """One output of the joint graph: its planned placement and global shape, whether it is a
    parameter gradient, and whether this stage averages it over dp."""

    placement: Placement
    shape: tuple[int, ...]
    gradient: bool
    dp_mean: bool


def output_specs(joint: fx.GraphModule, plan: dict[fx.Node, Strategy], num_fwd_outputs: int) -> list[Output | None]:
    """Per output of the joint graph (None where it is not a tensor: a size the step returns, as
    Dynamo does to rebuild an object the step made and kept, a block mask set on a module, is
    the global one on every rank)."""
    specs: list[Output | None] = []
    for k, a in enumerate(joint.graph.output_node().args[0]):
        if not isinstance(a, fx.Node) or isinstance(a.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
            specs.append(None)
            continue
        p, v = plan[a].outs[0], out_vals(a)[0]
        gradient = k >= num_fwd_outputs
        floating = isinstance(v, torch.Tensor) and v.is_floating_point()
        specs.append(
            Output(
                p,
                tuple(v.shape) if v is not None else (),
                gradient,
                gradient and (p == P or (a.target is not REDUCE and floating)),
            )
        )
    return specs


def _bucketed_all_reduce(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """All-reduce ``tensors`` in flat buckets of up to ``BUCKET_BYTES`` per dtype. Measured on 2
    CPU ranks (small preset, seq 4096): per-parameter all-reduces in the backward doubled the time
    spent waiting on collectives (294 ms vs 140 ms per 2 steps)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    buckets: dict[torch.dtype, list[list[int]]] = {}
    for i, t in enumerate(tensors):
        groups = buckets.setdefault(t.dtype, [[]])
        size = t.numel() * t.element_size()
        if groups[-1] and sum(tensors[j].numel() * t.element_size() for j in groups[-1]) + size > BUCKET_BYTES:
            groups.append([])
        groups[-1].append(i)
    for groups in buckets.values():
        for idx in groups:
            flat = funcol.all_reduce(torch.cat([tensors[i].reshape(-1) for i in idx]), "sum", group)
            for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
                out[i] = piece.view(tensors[i].shape)
    return out


def place_outputs(values, specs: list[Output | None], ctx: SpContext):
    """``values`` (the joint graph's outputs on this rank, as planned) as one device returns them."""

    def replicated(k: int) -> torch.Tensor:
        s = specs[k]
        return redistribute(values[k], s.placement, R, ctx.n, ctx.rank, ctx.group, s.shape)

    partial = [k for k, s in enumerate(specs) if s is not None and s.gradient and s.placement == P]
    if ctx.dp == 1:
        done = dict(zip(partial, _bucketed_all_reduce([values[k] for k in partial], ctx.group)))
    else:
        rest = [k for k, s in enumerate(specs) if s is not None and s.dp_mean and k not in partial]
        summed = _bucketed_all_reduce([values[k] for k in partial], ctx.world_group) + _bucketed_all_reduce(
            [replicated(k) for k in rest], ctx.dp_group
        )
        done = {k: t / ctx.dp for k, t in zip(partial + rest, summed)}
    return type(values)(
        done[k] if k in done else (replicated(k) if s is not None else values[k]) for k, s in enumerate(specs)
    )
