"""The torch.compile backend: capture -> propagate -> solve -> localize -> partition -> compile."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from .._plan import Plan, build_plan
from ..errors import PlanError
from ..partition._checkpoint import checkpoint_partition
from ..partition._fsdp import FSDP_OPS, gathers_at_first_use
from ..partition._gqa import fold_kv_repeats
from ..partition._localize import localize
from ..partition._tiling import MAX_TILES
from ..propagate._solver import propagate, solve

__all__ = ["Options", "make_backend"]

log = logging.getLogger("autosp")
aten = torch.ops.aten


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """How ``autosp.shard`` compiles.

    compiler: "inductor" (default; C++ on CPU, Triton on GPU) or "aot_eager" (no codegen: fast
        compiles, for tests), e.g. ``compiler="aot_eager"``.
    mem_weight: weight of a byte left on a rank against a byte sent, in the plan's objective,
        e.g. ``mem_weight=4.0``.
    checkpoint: activation checkpointing, "auto" (default), "none", "full", or a budget in bytes
        per rank for the step's peak beyond parameters and optimizer state, e.g.
        ``checkpoint=8 * 2**30``.
    attention: "auto" (by cost), or a kernel every attention op must run as: "ulysses", "ring",
        "kv_gather" or "hybrid" (on a 2D sp mesh), e.g. ``attention="ring"``.
    """

    compiler: str = "inductor"
    mem_weight: float = 4.0
    checkpoint: str | int = "auto"
    attention: str = "auto"
    every_rung: bool = False  # evaluate every checkpointing rung (planning tools: autosp plan)


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    # mean over a sharded dim is a partial sum over the *global* count: decompose so the sum
    # carries Partial and the division stays exact.
    dims = range(x.ndim) if dim is None or dim == [] else ([dim] if isinstance(dim, int) else dim)
    count = math.prod(x.shape[d] for d in dims)
    return torch.sum(x, dim if dim is not None else list(range(x.ndim)), keepdim, dtype=dtype) / count


DECOMPOSITIONS = {
    **get_decompositions([aten.nll_loss_forward, aten.nll_loss_backward]),
    aten.mean.dim: _mean,
    aten.mean.default: lambda x, *, dtype=None: _mean(x, None, False, dtype=dtype),
}


def _debug(name: str, gm: fx.GraphModule, t0: float) -> None:
    if os.environ.get("AUTOSP_DEBUG") == "1":
        log.warning("autosp pass %s: %.3f s, %d nodes\n%s", name, time.perf_counter() - t0,
                    len(gm.graph.nodes), gm.print_readable(print_output=False))


def _compiler(name: str) -> Callable:
    if name == "aot_eager":
        # torch's own aot_eager: boxed code that frees each input after its last use (saved
        # activations die as the backward goes, as under Inductor)
        from torch._dynamo.backends.debugging import boxed_nop
        return boxed_nop
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table

        def inductor(gm: fx.GraphModule, example_inputs):
            # autosp planned on ops Inductor decomposes further; apply its table to the
            # per-rank graph (collectives included) before lowering
            with detect_fake_mode(example_inputs) or contextlib.nullcontext():
                gm = make_fx(gm, decomposition_table=select_decomp_table())(*example_inputs)
            # autosp's graphs are already in the order its memory plan assumes (tiles one at a
            # time, recomputation before its use). Inductor's peak-memory reordering (torch 2.13)
            # undid that: the tiled "full" rung at 8192 tokens over 2 measured 162.7 MiB with it
            # and 100.5-107.5 MiB without (102.4 MiB predicted); steps 3.56 s with it, 3.15-3.70 s
            # without (separate runs).
            with torch._inductor.config.patch(reorder_for_peak_memory=False):
                return compile_fx_inner(gm, example_inputs)
        return inductor
    raise ValueError(f"autosp: unknown compiler {name!r}; use 'inductor' or 'aot_eager'")


_exchanges: dict[str, int] = {}  # store exchanges so far, per process group and kind


def _exchange(mesh, kind: str, value: str) -> list[str] | None:
    """Every sp rank's ``value``, in rank order, through the c10d store (None on a single rank
    or a fake process group)."""
    group = mesh.sp_group
    if mesh.sp_size == 1 or torch.distributed.get_backend(group) == "fake":
        return None
    dist = torch.distributed
    key = f"{kind}/{group.group_name}"
    k = _exchanges[key] = _exchanges.get(key, 0) + 1
    base = dist.distributed_c10d._get_default_store()
    store = dist.PrefixStore(f"autosp/{key}/{k}/", base)
    ranks = [str(r) for r in dist.get_process_group_ranks(group)]
    store.set(str(dist.get_rank()), value)
    try:
        store.wait(ranks, base.timeout)
    except RuntimeError as e:
        raise PlanError(None, f"not every rank of the sp group compiled this step within {base.timeout} ({e})",
                        "call the sharded step on every rank of the group, with the same arguments") from e
    return [store.get(r).decode() for r in ranks]


def _largest_peaks(mesh):
    def largest(peaks: list[int]) -> list[int]:
        got = _exchange(mesh, "peaks", ",".join(map(str, peaks)))
        if got is None:
            return peaks
        per_rank = [[int(x) for x in v.split(",")] for v in got]
        if len({len(p) for p in per_rank}) != 1:
            raise PlanError(None, f"the sp ranks built different checkpointing ladders ({[len(p) for p in per_rank]} "
                            "rungs)", "call the sharded step with identical, full inputs on every rank of the group")
        return [max(col) for col in zip(*per_rank)]
    return largest


def _collective_order(*graphs: fx.GraphModule) -> list[list[str]]:
    """The collectives each graph issues, in order: op, and process group numbered by first use
    (ranks of different sub-groups of a 2D sp mesh use different groups in the same roles)."""
    groups: dict[str, int] = {}
    return [[f"{nd.target}@{groups.setdefault(str(nd.args[-1]), len(groups))}" for nd in g.graph.nodes
             if nd.op == "call_function" and ("_c10d_functional" in str(nd.target) or nd.target in FSDP_OPS)
            and "wait_tensor" not in str(nd.target)]
            for g in graphs]


def _check_same_schedule(fw: fx.GraphModule, bw: fx.GraphModule, mesh) -> None:
    """The partitioned graphs must issue the same collectives in the same order on every rank.
    The per-rank graphs differ in their compute (uneven shards, ring attention's blocks), and the
    partitioner decides per rank which graph a node goes to, so a difference here would be a
    hang in the first step: make it an error now."""
    order = _collective_order(fw, bw)
    got = _exchange(mesh, "schedule", hashlib.sha256(repr(order).encode()).hexdigest() + f" {len(order[0])} {len(order[1])}")
    if got is not None and len({g.split()[0] for g in got}) != 1:
        raise PlanError(None, "the sp ranks' partitioned graphs issue different collectives (forward, backward counts "
                        f"per rank: {[tuple(g.split()[1:]) for g in got]}); running them would hang",
                        "this is an autosp bug; please report it with AUTOSP_DEBUG=1 output. checkpoint='none' may "
                        "avoid it meanwhile")


def _check_same_plan(plan: Plan, mesh) -> None:
    """Every rank must run the same collectives: compare plan fingerprints once per compile, so a
    divergence is an error here rather than a hang (or a gloo abort) in the first step.

    The exchange goes through the c10d store, not a collective on the sp group: it does not take
    a slot in the group's collective sequence, and it cannot deadlock with the gloo transport
    mid-compile (an all_gather_object here hung intermittently on gloo with 2 and 4 ranks)."""
    digest = hashlib.sha256(repr([(c.kind, c.src, c.dst, c.shape) for c in plan.collectives]).encode()).hexdigest()
    if os.environ.get("AUTOSP_DEBUG") == "1":
        log.warning("autosp plan check on %s: %d collectives", mesh.sp_group.group_name, len(plan.collectives))
    digests = _exchange(mesh, "plan", digest)
    if digests is not None and len(set(digests)) != 1:
        raise PlanError(None, f"the sp ranks built different plans (fingerprints {[d[:12] for d in digests]}); a rank "
                        "saw other shapes or code", "call the sharded step with identical, full inputs on every rank "
                        "of the group")


def make_backend(mesh, options: Options, on_plan: Callable[[Plan], None] | None = None):
    """A Dynamo backend that runs the training step sequence-parallel over ``mesh``'s sp axis."""
    n, rank, group = mesh.sp_size, mesh.sp_rank, mesh.sp_group.group_name

    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs, **kwargs):
        t0 = time.perf_counter()
        folded = fold_kv_repeats(joint, n)
        candidates = propagate(joint, n, mesh.sp_mesh, options.attention, mesh.ulysses_size)
        choice = solve(joint, candidates, n, mem_weight=options.mem_weight)
        plan = build_plan(joint, choice, n)
        plan = dataclasses.replace(plan, notes=(*folded, *plan.notes))
        _check_same_plan(plan, mesh)
        _debug("solve", joint, t0)
        t0 = time.perf_counter()
        dp = mesh.dp_size

        def per_rank(tiles: int = 1):
            local = localize(joint, choice, joint_inputs, n, rank, group, num_fwd_outputs, dp,
                             mesh.dp_group.group_name if dp > 1 else None,
                             torch.distributed.group.WORLD.group_name if dp > 1 else None,
                             (mesh.ulysses_size, *mesh.hybrid_groups) if mesh.hybrid_groups else None, tiles=tiles)
            return gathers_at_first_use(local) if local is not None else None

        local = per_rank()
        _debug("localize", local, t0)
        t0 = time.perf_counter()
        fw, bw, ckpt = checkpoint_partition(local, joint_inputs, options.checkpoint, num_fwd_outputs=num_fwd_outputs,
                                            every_rung=options.every_rung,
                                            largest=_largest_peaks(mesh), tiled=lambda: per_rank(MAX_TILES), **kwargs)
        _debug("checkpoint (backward graph)", bw, t0)
        _check_same_schedule(fw, bw, mesh)
        if on_plan is not None:
            on_plan(dataclasses.replace(plan, memory=ckpt.memory, checkpoint=ckpt))
        return fw, bw

    compile_fn = _compiler(options.compiler)
    return aot_autograd(fw_compiler=compile_fn, bw_compiler=compile_fn, partition_fn=partition,
                        decompositions=DECOMPOSITIONS, keep_inference_input_mutations=True)
