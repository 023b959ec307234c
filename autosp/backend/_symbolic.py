"""Symbolic sequence lengths: one compile serves every length.

``autosp.shard`` captures the step with the sharded (sequence) dims of its inputs dynamic, so the
joint graph's sizes are expressions of a symbol S (Dynamo's ``s0``, ...). Two halves of the
backend read it differently:

- **Planning** (propagation, the solver, the plan ``explain`` shows, the tiling choice) runs on
  ``hinted(joint)``: a copy of the graph with every size at its hint, the length the compile was
  first called with. Costs are compared at that representative length; the plan does not depend
  on the length otherwise (its rules read divisibility, which the per-rank graph guards).
- **The per-rank graph** is traced from the symbolic joint graph: rank i holds
  ``ceil((S - i) / n)`` rows, with no guard on S or on ``S % n``. What the compile is
  specialised on is a choice the plan makes by the length, once per choice: the tile count
  where the checkpointing pass weighs tiled rungs (``partition._tiling``), and, where the first
  length divides by the ranks, lengths that divide (``guard_even_shards``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import sympy
import torch
import torch.fx as fx
from torch._functorch.compile_utils import fx_graph_cse
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._sympy.numbers import int_oo

from .._graph import SYM_TYPES, graph_module, hint, out_vals, tensor_inputs
from ..errors import PlanError
from ..propagate._placement import shard_spec
from ._checks import collective_digest, cse_alike, over_ranks

log = logging.getLogger("autosp")

__all__ = [
    "is_symbolic",
    "hinted",
    "lengths_note",
    "guard_even_shards",
    "rank_graph",
    "every_rank_graphs",
    "guard_budget_lengths",
]


def _symbolic_value(v) -> bool:
    if isinstance(v, SYM_TYPES):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride()))


def is_symbolic(gm: fx.GraphModule) -> bool:
    """Whether any of the graph's values has a symbolic size."""
    return any(_symbolic_value(v) for nd in gm.graph.nodes for v in tree_leaves(nd.meta.get("val")))


def hinted(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of ``gm`` with every size at its hint (static fake tensors; the symbolic scalars
    folded into the arguments that read them), and the map from its nodes to ``gm``'s."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def concrete(v):
        if not isinstance(v, torch.Tensor):
            return hint(v)
        with mode:
            return torch.empty_strided(hint(v.shape), hint(v.stride()), dtype=v.dtype, device=v.device)

    scalars = []
    for old, new in env.items():
        val = old.meta.get("val")
        if isinstance(val, SYM_TYPES):
            scalars.append((new, hint(val)))
        elif val is not None:
            new.meta["val"] = tree_map(concrete, val)
    for new, value in reversed(scalars):
        for user in list(new.users):
            user.args = fx.node.map_arg(user.args, lambda a, new=new, value=value: value if a is new else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a, new=new, value=value: value if a is new else a)
        graph.erase_node(new)
    folded = {new for new, _ in scalars}
    return graph_module(gm, graph), {new: old for old, new in env.items() if new not in folded}


def lengths_note(inputs) -> str:
    """The plan's note on its lengths: each symbolic size of the inputs, the length it was planned
    at, and the range of lengths this compile serves (what its guards allow so far)."""
    seen = {}
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor):
            for size in t.shape:
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    seen.setdefault(size.node.expr, size)
    parts = []
    for sym, size in seen.items():
        r = size.node.shape_env.var_to_range.get(sym)
        upper = "" if r is None or r.upper in (int_oo, sympy.oo) else f" <= {int(r.upper)}"
        lower = "" if r is None else f"{int(r.lower)} <= "
        parts.append(f"{sym} = {hint(size)} (this compile serves {lower}{sym}{upper})")
    return "symbolic sequence length: planned at " + ", ".join(parts)


def guard_even_shards(strategy: dict, n: int) -> None:
    """Specialise the compile on each divisibility the plan may rely on: for every sharded
    placement the plan gives a symbolic dim (an output, or what an input is moved to), a hint
    that divides into ``n`` balanced blocks evenly becomes a guard that it does. Rules may offer
    strategies for even shards only (DTensor's, hybrid attention); a plan made at an uneven hint
    holds for even lengths too (the balanced split is then even), so that way needs no guard.
    The guard also lets the per-rank graph know its shards are even (the fast paths: no padded
    gathers). Dropping it where the plan at an uneven length was the same, as tried, changed the
    main job's per-rank graph at 4096 tokens: its "auto" rung went from "recompute <= 80 flop/B"
    (39.9 MiB predicted) to "recompute <= 16 flop/B" (58.8 MiB; 61.0 MiB measured, against 43.0).
    At most two compiles follow per tile count: lengths that divide, lengths that do not."""
    for nd, s in strategy.items():
        pairs = list(zip(out_vals(nd), s.outs))
        pairs += [(out_vals(u)[i], q) for (u, i), q in zip(tensor_inputs(nd), s.ins)]
        for v, p in pairs:
            spec = shard_spec(p) if v is not None and p is not None else None
            if spec is None or not isinstance(v.shape[spec[0]], torch.SymInt):
                continue
            size, blocks = v.shape[spec[0]], spec[1] * n
            if hint(size) % blocks == 0:
                torch._check(size % blocks == 0)


_FAILED = "autosp: failed"  # what a rank whose trace failed sends in place of its guards


def rank_graph(trace: Callable, ctx, shape_env) -> fx.GraphModule:
    """This rank's per-rank graph on a symbolic length (``trace(ctx)``), traced once, with every
    rank's guards. Each rank traces its own graph, then the ranks exchange the guards their traces
    added (sympy expressions of the shared length symbols, true at the shared hint) and each adds
    the others', so the ranks compile at the same lengths (``every_rank_graphs``' reason) without
    every rank tracing every rank's graph (n traces a rank, n^2 in the job: 30 of 47 s of an 8-rank
    compile, ``benchmarks/compile_time.py``). The ranks' graphs must still issue the same
    collectives: each rank's graph is kept with its common subexpressions merged where every rank's
    merged graph issues the same collectives, else unmerged (``cse_alike``'s rule); where neither
    agrees (a choice one rank's trace made from a guard another's did not add), every rank falls
    back to tracing every rank's graph in the same order. On a fake process group (``explain``,
    the plan tests) there are no other ranks to exchange with: this rank's graph and guards."""
    start = len(shape_env.guards)
    try:
        mine, failed = trace(ctx), None
    except Exception as e:  # every rank must hear of it before any raises
        mine, failed = None, e
    if failed is None:
        merged = graph_module(mine, fx_graph_cse(mine.graph))
        digests = (collective_digest(merged), collective_digest(mine))
        got = over_ranks(ctx, "rank graphs", ([g.expr for g in shape_env.guards[start:]], digests))
    else:  # the others wait for this rank's guards: tell them, then raise (not a hang)
        got = over_ranks(ctx, "rank graphs", (_FAILED, f"{type(failed).__name__}: {failed}"[:2000]))
        raise failed
    if got is None:
        return merged
    for rank, (guards, why) in enumerate(got):
        if guards == _FAILED:
            raise PlanError(
                None,
                f"sp rank {rank} could not build its per-rank graph (each rank traces its own): {why}",
                "see that rank's error, which names the op",
            )
    if len({d[0] for _, d in got}) == 1:
        graph = merged
    elif len({d[1] for _, d in got}) == 1:
        graph = mine
    else:
        log.info("autosp: the sp ranks' per-rank graphs, traced once each, issue different collectives; tracing all")
        return cse_alike(every_rank_graphs(trace, ctx), ctx.rank)
    for rank, (guards, _) in enumerate(got):
        for expr in guards if rank != ctx.rank else ():
            if shape_env._maybe_evaluate_static(expr) is None:  # not known already: a guard
                shape_env.evaluate_expr(expr)
    return graph


def every_rank_graphs(trace: Callable, ctx) -> list:
    """Every rank's per-rank graph, ``trace(ctx)`` tracing the one of the rank ``ctx`` names, on
    the compile's fake inputs, so the guards it adds land in their shape env: this rank's compile
    takes the guards of every rank's graph. Each rank's local sizes are its own expressions of S
    (rank i holds ``ceil((S - i) / n)`` rows), and the ops on them guard on what they read: a
    reshape's contiguity check, a matmul's ``Ne(rows, 1)``. A guard one rank alone adds makes
    Dynamo recompile that rank alone at a length that breaks it, while the others run on: the
    ranks then wait in different collectives until the timeout (a chunk pad over lengths 17..27
    on 2 ranks did). With every rank's guards on every rank, the ranks compile at the same
    lengths. Every process traces the ranks in the same order (0 first), so what a trace reads
    of the shape env at each step is the same on every rank (``known_alike``)."""
    return [trace(dataclasses.replace(ctx, rank=rank)) for rank in range(ctx.n)]


def guard_budget_lengths(ckpt, joint_inputs) -> tuple[str, ...]:
    """Guard a compile under a ``checkpoint=`` budget to the lengths its rung holds for
    (``Checkpoint.lengths``): a length whose peak the rung would take past the budget, or at
    which a rung that recomputes less fits, compiles again (once per rung, never per length).
    The note for the plan, or none."""
    if ckpt.lengths is None:
        return ()
    symbol, lo, hi = ckpt.lengths
    length = next(
        (
            d
            for t in tree_leaves(joint_inputs)
            if isinstance(t, torch.Tensor)
            for d in t.shape
            if isinstance(d, torch.SymInt) and d.node.expr == symbol
        ),
        None,
    )
    if length is None or (lo is None and hi is None):
        return ()
    if lo is not None:
        torch._check(length >= lo)
    if hi is not None:
        torch._check(length <= hi)
    span = f"{lo if lo is not None else 2}..{hi if hi is not None else 'any'}"
    return (
        f"checkpoint budget: rung {ckpt.chosen!r} is the budget's at lengths {symbol} = {span}; "
        "another length compiles again",
    )
