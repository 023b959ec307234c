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
  length divides by the ranks and the plan made at the next length that does not is another,
  lengths that divide (``guard_lengths``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._sympy.numbers import int_oo

from .._context import SpContext
from .._graph import SYM_TYPES, hint, out_vals, tensor_inputs
from ..errors import PlanError
from ..propagate import propagate, solve
from ..propagate._placement import shard_spec

__all__ = ["is_symbolic", "hinted", "lengths_note", "guard_lengths"]


def _symbolic_value(v) -> bool:
    if isinstance(v, SYM_TYPES):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride()))


def is_symbolic(gm: fx.GraphModule) -> bool:
    """Whether any of the graph's values has a symbolic size."""
    return any(_symbolic_value(v) for nd in gm.graph.nodes for v in tree_leaves(nd.meta.get("val")))


def at_lengths(x, at: Mapping):
    """``x`` (a size, or a sequence of them) with the length symbols of ``at`` at its values and
    every other symbol at its hint."""
    if isinstance(x, (list, tuple)):
        return [at_lengths(a, at) for a in x] if isinstance(x, list) else tuple(at_lengths(a, at) for a in x)
    if isinstance(x, SYM_TYPES) and x.node.expr.free_symbols & at.keys():
        expr, env = x.node.expr, x.node.shape_env
        subs = {s: at[s] if s in at else env.backed_var_to_val.get(s) for s in expr.free_symbols}
        if None not in subs.values():
            return x.node.pytype(expr.xreplace(subs))
    return hint(x)


def hinted(gm: fx.GraphModule, at: Mapping | None = None) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of ``gm`` with every size at its hint (static fake tensors; the symbolic scalars
    folded into the arguments that read them), and the map from its nodes to ``gm``'s. ``at``:
    values for some length symbols instead of their hints (``even_shards_needed``)."""
    value = hint if not at else functools.partial(at_lengths, at=at)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def concrete(v):
        if not isinstance(v, torch.Tensor):
            return value(v)
        with mode:
            return torch.empty_strided(value(v.shape), value(v.stride()), dtype=v.dtype, device=v.device)

    scalars = []
    for old, new in env.items():
        val = old.meta.get("val")
        if isinstance(val, SYM_TYPES):
            scalars.append((new, value(val)))
        elif val is not None:
            new.meta["val"] = tree_map(concrete, val)
    for new, v in reversed(scalars):
        for user in list(new.users):
            user.args = fx.node.map_arg(user.args, lambda a, new=new, v=v: v if a is new else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a, new=new, v=v: v if a is new else a)
        graph.erase_node(new)
    folded = {new for new, _ in scalars}
    return fx.GraphModule(gm, graph), {new: old for old, new in env.items() if new not in folded}


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


def even_shards(strategy: dict, n: int, value: Callable = hint) -> list[tuple[torch.SymInt, int]]:
    """The divisibilities a plan may rely on: for every sharded placement ``strategy`` gives a
    symbolic dim (an output, or what an input is moved to), (its size, the blocks it splits into)
    where that size, read by ``value`` (at its hint), divides into the ``n`` balanced blocks
    evenly. Rules may offer strategies for even shards only (DTensor's, hybrid attention); a plan
    made where no symbolic shard divides holds for every length (the balanced split of any
    length is one its rules planned)."""
    out = []
    for nd, s in strategy.items():
        pairs = list(zip(out_vals(nd), s.outs))
        pairs += [(out_vals(u)[i], q) for (u, i), q in zip(tensor_inputs(nd), s.ins)]
        for v, p in pairs:
            spec = shard_spec(p) if v is not None and p is not None else None
            if spec is None or not isinstance(v.shape[spec[0]], torch.SymInt):
                continue
            size, blocks = v.shape[spec[0]], spec[1] * n
            if value(size) % blocks == 0:
                out.append((size, blocks))
    return out


def uneven_lengths(evens: list[tuple[torch.SymInt, int]], tries: int = 8) -> dict | None:
    """Values for the length symbols of ``evens``' sizes near their hints at which none of them
    divides into its blocks (the next length up, or the one after, ...); None if no such length
    is within ``tries`` (two sharded sizes of opposite parity, S and S - 1, over 2 ranks)."""
    env = evens[0][0].node.shape_env
    syms = {s for size, _ in evens for s in size.node.expr.free_symbols}
    if not syms <= env.backed_var_to_val.keys():
        return None
    for k in range(1, tries + 1):
        at = {s: int(env.backed_var_to_val[s]) + k for s in syms}
        if all(at_lengths(size, at) % blocks for size, blocks in evens):
            return at
    return None


def guard_even_shards(evens: list[tuple[torch.SymInt, int]]) -> None:
    """Specialise the compile on each divisibility of ``evens`` (``even_shards``): a guard that
    the size divides into its blocks, so lengths that do not compile once more (with a plan for
    them). At most two compiles follow per tile count: lengths that divide, lengths that do not."""
    for size, blocks in evens:
        torch._check(size % blocks == 0)


def _placed(strategy: dict) -> dict:
    """A strategy's placements and kernels (not its costs, which read the length)."""
    return {nd: (s.outs, s.ins, s.introduces, s.kernel) for nd, s in strategy.items()}


def guard_lengths(joint: fx.GraphModule, strategy: dict, ctx: SpContext) -> None:
    """Guard a symbolic compile to lengths that divide where its plan (``strategy``, of ``joint``,
    made at the hint) may rely on even shards, unless the plan made at a length that does not
    divide (``uneven_lengths``) is the same: then it serves every length, and the compile too."""
    evens = even_shards(strategy, ctx.n)
    if not evens:
        return
    at = uneven_lengths(evens)
    if at is not None:
        other, to_joint = hinted(joint, at)
        try:
            alt = solve(other, propagate(other, ctx), ctx)
        except PlanError:  # lengths that do not divide have no plan: the guard keeps them apart
            alt = None
        if alt is not None:
            alt = {to_joint[nd]: s for nd, s in alt.strategy.items()}
            if _placed(alt) == _placed(strategy) and not even_shards(alt, ctx.n, functools.partial(at_lengths, at=at)):
                return
    guard_even_shards(evens)
