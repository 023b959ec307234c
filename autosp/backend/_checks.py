"""Cross-rank checks at compile time: every rank of an sp group must build the same plan, issue
the same collectives in the same order (``cse_alike`` keeps a merge from breaking that), and take
the same checkpointing decision; a difference would be a hang (or a gloo abort) in the first
step, so it is an error at compile time instead.

The exchanges go through the c10d store, not a collective on the sp group: they take no slot in
the group's collective sequence, and cannot deadlock with the gloo transport mid-compile (an
all_gather_object here hung intermittently on gloo with 2 and 4 ranks).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import pickle

import torch.distributed as dist
import torch.fx as fx
from torch._functorch.compile_utils import fx_graph_cse

from .._context import SpContext
from .._graph import graph_module
from ..errors import PlanError
from ..partition._fsdp import FSDP_OPS
from ._plan import Plan

__all__ = [
    "check_same_plan",
    "check_same_schedule",
    "cse_alike",
    "collective_digest",
    "largest_peaks",
    "smallest_over_ranks",
    "any_rank",
    "over_ranks",
]

log = logging.getLogger("autosp")

_exchanges: dict[str, int] = {}  # store exchanges so far, per process group and kind


def _exchange(ctx: SpContext, kind: str, value: str) -> list[str] | None:
    """Every sp rank's ``value``, in rank order, through the c10d store (None on a single rank
    or a fake process group)."""
    group = ctx.process_group
    if ctx.n == 1 or dist.get_backend(group) == "fake":
        return None
    key = f"{kind}/{group.group_name}"
    k = _exchanges[key] = _exchanges.get(key, 0) + 1
    base = dist.distributed_c10d._get_default_store()
    store = dist.PrefixStore(f"autosp/{key}/{k}/", base)
    ranks = [str(r) for r in dist.get_process_group_ranks(group)]
    store.set(str(dist.get_rank()), value)
    try:
        store.wait(ranks, base.timeout)
    except RuntimeError as e:
        missing = [r for r in ranks if not store.check([r])]
        raise PlanError(
            None,
            f"not every rank of the sp group compiled this step within {base.timeout}: rank(s) "
            f"{', '.join(missing)} did not reach this rank's compile number {k} of the group "
            f"(at {kind!r}; {str(e).strip().splitlines()[0][:200]})",
            "call the sharded step on every rank of the group, with the same arguments; if every "
            "rank did, a rank compiled a different number of times (a guard that failed on some "
            "ranks only): TORCH_LOGS=recompiles on each rank names the guard; please report it",
        ) from e
    return [store.get(r).decode() for r in ranks]


def over_ranks(ctx: SpContext, kind: str, value) -> list | None:
    """Every sp rank's ``value`` (any picklable object), in rank order (None on a single rank or
    a fake process group): each rank calls this once per compile, at the same point."""
    got = _exchange(ctx, kind, base64.b64encode(pickle.dumps(value)).decode())
    return None if got is None else [pickle.loads(base64.b64decode(v)) for v in got]


def any_rank(ctx: SpContext, kind: str, flag: bool) -> bool:
    """Whether ``flag`` holds on any sp rank: a decision every rank takes alike (each rank calls
    this once per compile, at the same point)."""
    got = _exchange(ctx, kind, "1" if flag else "0")
    return flag if got is None else "1" in got


def _ints_over_ranks(ctx: SpContext, key: str, values: list[int]) -> list[list[int]] | None:
    """Every sp rank's list of ints, this rank's ``values`` among them, exchanged under ``key``
    (None where there is nothing to exchange with)."""
    got = _exchange(ctx, key, ",".join(map(str, values)))
    return None if got is None else [[int(x) for x in v.split(",")] if v else [] for v in got]


def smallest_over_ranks(ctx: SpContext):
    """A function of this rank's list of ints that returns, per item, the least over the sp
    ranks: [] where any rank's list is empty or their lengths differ (each rank calls it once
    per compile, at the same point)."""

    def smallest(values: list[int]) -> list[int]:
        per_rank = _ints_over_ranks(ctx, "smallest", values)
        if per_rank is None:
            return values
        if len({len(p) for p in per_rank}) != 1:
            return []
        return [min(column) for column in zip(*per_rank)]

    return smallest


def largest_peaks(ctx: SpContext):
    """A function of this rank's predicted peak per checkpointing rung that returns, per rung,
    the largest over the sp ranks: a budget is held against the rank that needs most."""

    def largest(peaks: list[int]) -> list[int]:
        per_rank = _ints_over_ranks(ctx, "peaks", peaks)
        if per_rank is None:
            return peaks
        if len({len(p) for p in per_rank}) != 1:
            raise PlanError(
                None,
                f"the sp ranks built different checkpointing ladders ({[len(p) for p in per_rank]} rungs)",
                "call the sharded step with identical, full inputs on every rank of the group",
            )
        return [max(col) for col in zip(*per_rank)]

    return largest


def cse_alike(graphs: list[fx.GraphModule], rank: int) -> fx.GraphModule:
    """``graphs[rank]`` (of every rank's per-rank graphs, in rank order) with its common
    subexpressions merged (AOTAutograd's CSE, which its partitioner runs otherwise) if merging
    leaves every rank's graph issuing the same collectives, else unmerged. Merging reads each
    rank's own graph: Falcon-H1's causal convolution recomputes in the backward an exchange its
    forward makes, and on a symbolic length one rank's trace built the two alike (merged: one
    all-to-all), the other's not (two); the ranks would then hang."""
    merged = [graph_module(g, fx_graph_cse(g.graph)) for g in graphs]
    if len({repr(_collective_order(g)) for g in merged}) == 1:
        return merged[rank]
    log.info("autosp: common subexpressions merge collectives on some sp ranks only; kept unmerged")
    return graphs[rank]


def collective_digest(graph: fx.GraphModule) -> str:
    """A fingerprint of the collectives ``graph`` issues, in order."""
    return hashlib.sha256(repr(_collective_order(graph)).encode()).hexdigest()


def _collective_order(*graphs: fx.GraphModule) -> list[list[str]]:
    """The collectives each graph issues, in order: op, and process group numbered by first use
    (ranks of different sub-groups of a 2D sp mesh use different groups in the same roles)."""
    groups: dict[str, int] = {}
    return [
        [
            f"{nd.target}@{groups.setdefault(str(nd.args[-1]), len(groups))}"
            for nd in g.graph.nodes
            if nd.op == "call_function"
            and ("_c10d_functional" in str(nd.target) or nd.target in FSDP_OPS)
            and "wait_tensor" not in str(nd.target)
        ]
        for g in graphs
    ]


def check_same_schedule(fw: fx.GraphModule, bw: fx.GraphModule | None, ctx: SpContext) -> None:
    """The partitioned graphs (``bw`` None: a forward-only step's one graph) must issue the same
    collectives in the same order on every rank. The per-rank graphs differ in their compute
    (uneven shards, ring attention's blocks), and the partitioner decides per rank which graph a
    node goes to."""
    order = _collective_order(*(g for g in (fw, bw) if g is not None))
    digest = hashlib.sha256(repr(order).encode()).hexdigest()
    got = _exchange(ctx, "schedule", f"{digest} " + " ".join(str(len(o)) for o in order))
    if got is not None and len({g.split()[0] for g in got}) != 1:
        raise PlanError(
            None,
            "the sp ranks' partitioned graphs issue different collectives (forward, backward counts "
            f"per rank: {[tuple(g.split()[1:]) for g in got]}); running them would hang",
            "this is an autosp bug; please report it with AUTOSP_DEBUG=1 output. checkpoint='none' may "
            "avoid it meanwhile",
        )


def check_same_plan(plan: Plan, ctx: SpContext) -> None:
    """Every rank must run the same collectives: compare plan fingerprints once per compile."""
    digest = hashlib.sha256(repr([(c.kind, c.src, c.dst, c.shape) for c in plan.collectives]).encode()).hexdigest()
    if os.environ.get("AUTOSP_DEBUG") == "1":
        log.warning("autosp plan check on %s: %d collectives", ctx.group, len(plan.collectives))
    digests = _exchange(ctx, "plan", digest)
    if digests is not None and len(set(digests)) != 1:
        raise PlanError(
            None,
            f"the sp ranks built different plans (fingerprints {[d[:12] for d in digests]}); a rank "
            "saw other shapes or code",
            "call the sharded step with identical, full inputs on every rank of the group",
        )
