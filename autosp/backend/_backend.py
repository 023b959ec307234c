"""The torch.compile backend: the autosp passes, in order, on AOTAutograd's joint graph.

    fold or replicate K/V heads -> propagate -> solve -> (plan, checked across ranks) -> localize
    -> checkpoint and partition (untiled and tiled ladders) -> (schedule checked) -> compile

Each pass is a function of the graph and one ``SpContext``; ``_run`` wraps each once for
``AUTOSP_DEBUG=1`` (time and the graph it hands on).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd.utils import call_func_at_runtime_with_args
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from .._context import Options, SpContext
from ..errors import collective_error
from ..partition import (
    checkpoint_partition,
    fold_kv_repeats,
    gathers_at_first_use,
    localize,
    plan_tiles,
    replicate_kv_heads,
)
from ..propagate import propagate, solve
from ._checks import any_rank, check_same_plan, check_same_schedule, largest_peaks, smallest_over_ranks
from ._plan import Plan, build_plan, timing_line
from ._symbolic import guard_budget_lengths, guard_even_shards, hinted, is_symbolic, lengths_note, rank_graph
from ._unchunk import unchunk

__all__ = ["make_backend", "DECOMPOSITIONS", "CALL_STARTED"]

log = logging.getLogger("autosp")
aten = torch.ops.aten


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


# when the call that compiles began (``ShardedStep`` sets it around each call): capture is the
# time from it to the joint graph reaching the backend
CALL_STARTED: contextvars.ContextVar[float | None] = contextvars.ContextVar("autosp_call_started", default=None)
# the compile under way's phase times (``Plan.timings``), which ``_run`` adds to
_TIMES: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("autosp_times", default=None)
# pass -> the compile phase its time counts in
_PHASE = {"fold K/V repeats": "propagate", "replicate K/V heads": "propagate", "plan": "solve"}


def _run(name: str, fn: Callable, *args, **kwargs):
    """One pass, its time added to the compile's phase (``Plan.timings``); with
    ``AUTOSP_DEBUG=1`` its time and the graph it hands on are logged."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    times = _TIMES.get()
    if times is not None:
        phase = _PHASE.get(name, name)
        times[phase] = times.get(phase, 0.0) + time.perf_counter() - t0
    if os.environ.get("AUTOSP_DEBUG") == "1":
        graphs = [x for x in (out if isinstance(out, tuple) else (out,)) if isinstance(x, fx.GraphModule)]
        graphs = graphs or [a for a in args if isinstance(a, fx.GraphModule)]  # analyses: the graph they read
        log.warning(
            "autosp pass %s: %.3f s\n%s",
            name,
            time.perf_counter() - t0,
            "\n".join(f"{len(g.graph.nodes)} nodes\n{g.print_readable(print_output=False)}" for g in graphs),
        )
    return out


def inductor_graph(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """The per-rank graph retraced through Inductor's decomposition table (autosp planned on ops
    it decomposes further; collectives included), ready for lowering. The graph's views were
    recorded on the strides its own trace saw, and the table may lay a result out otherwise (its
    cat of a tensor and an empty one is a clone keeping the first's layout: litgpt's rotary q,
    transposed, then a view(-1) in an all-to-all, on a symbolic length): as reshapes, each stays a
    view where it can and copies where it cannot, as Inductor's post-grad pass makes them
    (``view_to_reshape``)."""
    from torch._inductor.decomposition import select_decomp_table

    for nd in gm.graph.find_nodes(op="call_function", target=aten.view.default):
        nd.target = aten.reshape.default
    gm.recompile()
    with detect_fake_mode(example_inputs) or contextlib.nullcontext():
        return make_fx(gm, decomposition_table=select_decomp_table())(*example_inputs)


def _compiler(name: str) -> Callable:
    if name == "aot_eager":
        # torch's own aot_eager: boxed code that frees each input after its last use (saved
        # activations die as the backward goes, as under Inductor)
        from torch._dynamo.backends.debugging import boxed_nop

        return boxed_nop
    from torch._inductor.compile_fx import compile_fx_inner

    def inductor(gm: fx.GraphModule, example_inputs):
        gm = inductor_graph(gm, example_inputs)
        # autosp's graphs are already in the order its memory plan assumes (tiles one at a
        # time, recomputation before its use). Inductor's peak-memory reordering (torch 2.13)
        # undid that: the tiled "full" rung at 8192 tokens over 2 measured 162.7 MiB with it
        # and 100.5-107.5 MiB without (102.4 MiB predicted); steps 3.56 s with it, 3.15-3.70 s
        # without (separate runs).
        with torch._inductor.config.patch(reorder_for_peak_memory=False):
            return compile_fx_inner(gm, example_inputs)

    return inductor


def _with_errors(compile_fn: Callable) -> Callable:
    """``compile_fn`` whose compiled graphs raise autosp's errors for collectives that fail at run
    time: the backward runs from ``loss.backward()``, outside the sharded step's call."""

    def compile(gm: fx.GraphModule, example_inputs):
        compiled = compile_fn(gm, example_inputs)

        def run(args):
            try:
                return call_func_at_runtime_with_args(compiled, args, steal_args=True)
            except RuntimeError as e:
                error = collective_error(e)
                if error is None:
                    raise
                raise error from e

        run._boxed_call = True  # AOTAutograd calls it with the list of inputs, which it may free
        return run

    return compile


def _solved(graph: fx.GraphModule, ctx: SpContext):
    """K/V repeats folded or K/V heads replicated, then propagate, solve and the plan (checked
    across ranks): (the graph planned, its nodes -> ``graph``'s where it is a hinted copy, else
    None; the choice; the plan). Planning reads sizes at their hints (a copy of the graph); the
    per-rank graph stays symbolic."""
    folded = _run("fold K/V repeats", fold_kv_repeats, graph, ctx.n)
    folded += _run("replicate K/V heads", replicate_kv_heads, graph, ctx)
    planned, to_graph = hinted(graph) if is_symbolic(graph) else (graph, None)
    candidates = _run("propagate", propagate, planned, ctx)
    choice = _run("solve", solve, planned, candidates, ctx)
    plan = _run("plan", build_plan, planned, choice, ctx.n, tuple(folded))
    check_same_plan(plan, ctx)
    return planned, to_graph, choice, plan


def _on_symbolic(choice, to_graph: dict | None, n: int):
    """The choice on the symbolic graph's nodes (guarded to even shards where the plan relies on them)."""
    if to_graph is None:
        return choice
    choice = dataclasses.replace(choice, strategy={to_graph[nd]: s for nd, s in choice.strategy.items()})
    guard_even_shards(choice.strategy, n)
    return choice


def _localizer(graph: fx.GraphModule, inputs, outputs: int, planned, to_graph, choice, ctx: SpContext):
    """(per_rank, tiling, guard_tiles) for ``graph``, solved as ``choice`` on ``planned`` (its
    hinted copy, ``to_graph`` mapping its nodes to ``graph``'s; None: no tiling, as for a forward
    only). ``per_rank(tiled=False)`` localizes ``graph`` for this rank, in ``tiling``'s tiles if
    ``tiled``; with a symbolic length it takes every rank's guards too, its common subexpressions
    merged where every rank's graph merges the same collectives (``rank_graph``)."""
    tiling, guard_tiles = (
        (None, None) if planned is None else plan_tiles(planned.graph, choice.strategy, ctx, symbolic=to_graph)
    )

    def tiles_of(c: SpContext):
        return tiling if c.rank == ctx.rank else plan_tiles(planned.graph, choice.strategy, c, symbolic=to_graph)[0]

    local_choice = _on_symbolic(choice, to_graph, ctx.n)

    def trace(c: SpContext, tiled: bool) -> fx.GraphModule:
        tiles = tiles_of(c) if tiled else None
        return localize(graph, local_choice, inputs, c, num_fwd_outputs=outputs, tiling=tiles)

    def per_rank(tiled: bool = False) -> fx.GraphModule:
        if to_graph is None:
            return gathers_at_first_use(trace(ctx, tiled))
        shape_env = detect_fake_mode(inputs).shape_env
        return rank_graph(lambda c: gathers_at_first_use(trace(c, tiled)), ctx, shape_env)

    return per_rank, tiling, guard_tiles


class _Clock:
    """Where a backend's compiles spend their time: the latest compile's phase times (``times``,
    its ``Plan.timings``), and one line logged when it is done."""

    def __init__(self, compile_fn: Callable):
        self.compile_fn = compile_fn
        self.times: dict[str, float] = {}

    def planner(self, fn: Callable) -> Callable:
        """``fn`` (a partition) with its passes' times in fresh ``times``, the capture's first."""

        @functools.wraps(fn)
        def run(*args, **kwargs):
            started = CALL_STARTED.get()
            self.times = {"capture": time.perf_counter() - started} if started is not None else {}
            token = _TIMES.set(self.times)
            try:
                return fn(*args, **kwargs)
            finally:
                _TIMES.reset(token)

        return run

    def compile(self, gm: fx.GraphModule, example_inputs):
        """The backend compiler's run, its time in the ``compile`` phase."""
        t0 = time.perf_counter()
        run = self.compile_fn(gm, example_inputs)
        self.times["compile"] = self.times.get("compile", 0.0) + time.perf_counter() - t0
        return run

    def backward(self, gm: fx.GraphModule, example_inputs):
        """The backward's compile, the compile's last (with a symbolic length, inside the
        forward's compile; else at the first backward)."""
        run = self.compile(gm, example_inputs)
        self.done()
        return run

    def done(self) -> None:
        level = logging.WARNING if os.environ.get("AUTOSP_DEBUG") == "1" else logging.INFO
        log.log(level, "autosp: step %s", timing_line(self.times))


def make_backend(
    mesh,
    options: Options,
    on_plan: Callable[[Plan], None] | None = None,
    on_run: Callable[[Plan], None] | None = None,
):
    """A Dynamo backend that runs the training step sequence-parallel over ``mesh``'s sp axis;
    ``on_plan`` receives each compile's plan, ``on_run`` the plan of the compile that runs, at each
    call (with a symbolic length, Dynamo picks among a step's compiles by the length)."""
    ctx = SpContext.of(mesh, options)
    plans: list[Plan] = []  # the plan of the compile under way, for its forward's compiled function
    captured: list[str] = []  # the notes of the rewrites of Dynamo's graph of the compile under way
    clock = _Clock(_with_errors(_compiler(options.compiler)))

    @clock.planner
    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs, **kwargs):
        planned, to_joint, choice, plan = _solved(joint, ctx)
        per_rank, tiling, guard_tiles = _localizer(joint, joint_inputs, num_fwd_outputs, planned, to_joint, choice, ctx)
        local = _run("localize", per_rank)
        # a symbolic compile's per-rank graph comes merged by ``rank_graph``: the partitioner's own
        # merging, rank by rank, may merge a collective on some ranks only
        with functorch_config.patch(cse=to_joint is None):
            fw, bw, ckpt = _run(
                "checkpoint",
                checkpoint_partition,
                local,
                joint_inputs,
                options.checkpoint,
                num_fwd_outputs=num_fwd_outputs,
                every_rung=options.every_rung,
                largest=largest_peaks(ctx),
                smallest=None if to_joint is None else smallest_over_ranks(ctx),
                tiled=None if tiling is None else lambda: per_rank(tiled=True),
                tiles=tiling.count if tiling is not None else 1,
                **kwargs,
            )
        # a symbolic compile serves the lengths that make its tile count only where the count
        # weighed in its checkpointing decision (on any rank: all guard alike)
        if to_joint is not None and any_rank(ctx, "tiles", ckpt.weighs_tiles):
            guard_tiles()
        check_same_schedule(fw, bw, ctx)
        budget = guard_budget_lengths(ckpt, joint_inputs)  # before the note, which reads the guards
        notes = plan.notes + tuple(captured) + ((lengths_note(joint_inputs),) if to_joint is not None else ()) + budget
        plan = dataclasses.replace(plan, memory=ckpt.memory, checkpoint=ckpt, notes=notes, timings=clock.times)
        plans[:] = [plan]
        if on_plan is not None:
            on_plan(plan)
        return fw, bw

    @clock.planner
    def forward_only(graph: fx.GraphModule, example_inputs):
        """A graph without a backward (the step under ``torch.no_grad()``: evaluation), planned and
        localized as a training step's forward is, untiled and without checkpointing."""
        _, to_graph, choice, plan = _solved(graph, ctx)
        inputs = [list(example_inputs), []]  # (primals, tangents), as localize reads a joint graph's
        outputs = len(graph.graph.output_node().args[0])
        per_rank, _, _ = _localizer(graph, inputs, outputs, None, to_graph, choice, ctx)
        local = _run("localize", per_rank)
        check_same_schedule(local, None, ctx)
        notes = (*captured, "forward only (no grad): no checkpointing, no tiling")
        notes += (lengths_note(inputs),) if to_graph is not None else ()
        plan = dataclasses.replace(plan, notes=plan.notes + notes, timings=clock.times)
        if on_plan is not None:
            on_plan(plan)
        plans[:] = [plan]
        run = fw_compile(local, example_inputs)
        clock.done()
        return run

    def fw_compile(gm: fx.GraphModule, example_inputs):
        run = clock.compile(gm, example_inputs)
        if on_run is None or not plans:
            return run
        plan = plans.pop()  # its partition's, just before

        def ran(args):
            on_run(plan)
            return run(args)

        ran._boxed_call = True
        return ran

    compile_joint = aot_autograd(
        fw_compiler=fw_compile,
        bw_compiler=clock.backward,
        inference_compiler=forward_only,
        partition_fn=partition,
        decompositions=DECOMPOSITIONS,
        keep_inference_input_mutations=True,
    )

    def backend(gm: fx.GraphModule, example_inputs):
        """Dynamo's graph of the step: chunked losses as one (``unchunk``), then AOTAutograd."""
        gm, captured[:] = unchunk(gm)
        return compile_joint(gm, example_inputs)

    return backend
