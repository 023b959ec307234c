"""FSDP2's parameter traffic inside the captured step: ``autosp::fsdp_gather`` makes a full
parameter from this rank's shard (all-gather over the FSDP group), and its gradient,
``autosp::fsdp_reduce``, is this rank's shard of the step's gradient (reduce-scatter over the
FSDP group, then an all-reduce over the ranks that hold the same shard, then the dp mean).

Both are opaque ops with their collectives inside, as FSDP2 issues them, so the per-rank graph
places and tags each as one node: a gather runs just before its first forward use and, when the
module reshards after forward (FSDP2's default), again in the backward (tagged for recompute),
so at most a layer's full parameters are alive at a time (ZeRO-3). Shards follow DTensor's
``Shard(d)`` layout (``torch.chunk``: ranks hold ceil(size / world) rows, the last ones fewer or
none), which is what ``fully_shard`` leaves on the module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .._graph import nbytes, op_args, out_vals
from ..propagate._placement import P, R
from ..propagate._strategy import Strategy, rule
from ._collectives import pad_to

__all__ = [
    "GatherArgs",
    "fsdp_gather",
    "fsdp_reduce",
    "gathers_at_first_use",
    "fsdp_tags",
    "fsdp_notes",
    "fsdp_reduce_call",
    "GATHER",
    "REDUCE",
    "FSDP_OPS",
]


class GatherArgs(NamedTuple):
    """``autosp::fsdp_gather``'s arguments after the shard, by name."""

    dim: int  # the sharded dim
    size: int  # its full size
    world: int  # ranks the parameter is sharded over
    outer: str  # the group holding the same shard ("": none)
    divide: int  # the dp replicas the gradient is averaged over
    reshard: bool  # gathered again in the backward (the module reshards after forward)
    dtype: torch.dtype  # FSDP2's param_dtype
    reduce_dtype: torch.dtype
    group: str  # the FSDP group


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


@torch.library.custom_op("autosp::fsdp_gather", mutates_args=())
def fsdp_gather(
    shard: torch.Tensor,
    dim: int,
    size: int,
    world: int,
    outer: str,
    divide: int,
    reshard: bool,
    dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    group: str,
) -> torch.Tensor:
    """The full parameter (``size`` along ``dim``) from every rank's shard, in ``dtype`` (FSDP2's
    ``param_dtype``: the shard is cast before the gather, as FSDP2 does). ``outer``, ``divide``,
    ``reduce_dtype`` and ``reshard`` are for the gradient and the checkpointing pass."""
    c = -(-size // world)
    x = pad_to(shard.to(dtype).movedim(dim, 0), 0, c).contiguous()
    full = _waited(funcol.all_gather_single(x, 0, group)).narrow(0, 0, size)
    return full.movedim(0, dim).contiguous()


@fsdp_gather.register_fake
def _(shard, dim, size, world, outer, divide, reshard, dtype, reduce_dtype, group):
    shape = list(shard.shape)
    shape[dim] = size
    return shard.new_empty(shape, dtype=dtype)


@torch.library.custom_op("autosp::fsdp_reduce", mutates_args=())
def fsdp_reduce(
    grad: torch.Tensor,
    dim: int,
    local: int,
    world: int,
    outer: str,
    divide: int,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
    group: str,
) -> torch.Tensor:
    """This rank's shard (``local`` rows along ``dim``) of the sum over every rank of ``grad``
    (each rank's contribution), divided by ``divide`` (the dp replicas: DDP's mean): summed in
    ``reduce_dtype`` over the FSDP group by a reduce-scatter, then over ``outer`` (the ranks that
    hold the same shard), and returned in the shard's dtype ``out_dtype``."""
    g = grad.to(reduce_dtype).movedim(dim, 0)
    c = -(-g.shape[0] // world)
    g = pad_to(g, 0, c * world).contiguous()
    out = _waited(funcol.reduce_scatter_single(g, "sum", 0, group)).narrow(0, 0, local)
    if outer:
        out = _waited(funcol.all_reduce(out.contiguous(), "sum", outer))
    if divide > 1:
        out = out / divide
    return out.to(out_dtype).movedim(0, dim).contiguous()


@fsdp_reduce.register_fake
def _(grad, dim, local, world, outer, divide, reduce_dtype, out_dtype, group):
    shape = list(grad.shape)
    shape[dim] = local
    return grad.new_empty(shape, dtype=out_dtype)


def _setup(ctx, inputs, output):
    shard, dim, size, world, outer, divide, reshard, dtype, reduce_dtype, group = inputs
    ctx.args = (dim, shard.shape[dim], world, outer, divide, reduce_dtype, shard.dtype, group)


def _backward(ctx, grad):
    return (fsdp_reduce(grad.contiguous(), *ctx.args),) + (None,) * 9


fsdp_gather.register_autograd(_backward, setup_context=_setup)

GATHER = torch.ops.autosp.fsdp_gather.default
REDUCE = torch.ops.autosp.fsdp_reduce.default
FSDP_OPS = (GATHER, REDUCE)


@rule(GATHER)
def _gather_rule(node, A, n):
    """Replicated over sp: every sp rank of a dp group gathers the same full parameter."""
    return [Strategy((R,), (R,))]


@rule(REDUCE)
def _reduce_rule(node, A, n):
    """The gradient's contribution on each rank: partial over sp (summed by the op's own
    collectives), or replicated (localize keeps it on sp rank 0 only, so the sum counts it once)."""
    return ([Strategy((R,), (P,))] if P in A[0] else []) + [Strategy((R,), (R,))]


def gathers_at_first_use(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each parameter gather of the per-rank joint graph to just before its first user, so
    the forward holds one module's full parameters at a time (the trace gathers them all before
    the model runs). The backward's recomputed gathers are placed at their use by the
    partitioner (it reorders the backward as autograd would run it)."""
    order = {nd: i for i, nd in enumerate(gm.graph.nodes)}
    for nd in list(gm.graph.nodes):
        if nd.op == "call_function" and nd.target is GATHER and nd.users:
            first = min(nd.users, key=order.__getitem__)
            first.prepend(nd)
    gm.graph.lint()
    gm.recompile()
    return gm


def fsdp_tags(gm: fx.GraphModule) -> dict[str, tuple[CheckpointPolicy, int]]:
    """Recompute tags for the parameter gathers (name -> (policy, region id)): recomputed in the
    backward where the module reshards after forward, else kept. The region ids lie above any
    layer's, so the partitioner never turns a gather into a kept boundary of the layer using it."""
    out = {}
    for i, nd in enumerate(gm.graph.find_nodes(op="call_function", target=GATHER)):
        reshard = op_args(nd)["reshard"]
        out[nd.name] = (CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE, 1_000_000 + i)
    return out


def fsdp_reduce_call(nd, s, target, args, kwargs, ctx):
    """The per-rank call of ``autosp::fsdp_reduce``: a replicated gradient is counted once in the
    op's sum over the sp ranks (on sp rank 0)."""
    if s.ins[0] == R and ctx.n > 1 and ctx.rank != 0:
        args = (torch.zeros_like(args[0]), *args[1:])
    return target, args, kwargs


def fsdp_notes(joint: fx.GraphModule) -> list[str]:
    """One line for FSDP2's parameters: how many, over how many ranks, and when they are gathered."""
    nodes = joint.graph.find_nodes(op="call_function", target=GATHER)
    if not nodes:
        return []
    gathers = [op_args(nd) for nd in nodes]
    full = sum(nbytes(out_vals(nd)[0]) for nd in nodes)
    worlds = sorted({g["world"] for g in gathers})
    again = sum(bool(g["reshard"]) for g in gathers)
    return [
        f"FSDP2: {len(nodes)} parameters ({full / 2**20:.1f} MiB in full) sharded over {worlds} ranks: each "
        f"gathered before its first use in the forward, {again} of them again in the backward (their modules "
        "reshard after forward), gradients reduce-scattered"
    ]
