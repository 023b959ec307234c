"""The torch.compile backend: the autosp passes, in order, on AOTAutograd's joint graph.

    fold or replicate K/V heads -> hint -> propagate -> solve -> plan (checked across ranks)
    -> tile -> even shards -> localize -> checkpoint and partition (untiled and tiled ladders)
    -> schedule (checked across ranks) -> finish -> compile

A compile is one record (``Compile``) that the passes hand on, each filling in its part; the
recipe is a flat list (``TRAINING``, and ``FORWARD_ONLY`` for a step without a backward) of
(name, pass, the phase its time counts in, the graphs it hands on). ``run_passes`` times each into
``Plan.timings`` and, with ``AUTOSP_DEBUG=1``, logs its time and the graphs it hands on.
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
from torch._functorch.partitioners import default_partition
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from .._context import Options, SpContext
from ..errors import collective_error
from ..partition import (
    Balance,
    Checkpoint,
    TileGuard,
    Tiling,
    checkpoint_partition,
    drop_lone_collectives,
    fold_kv_repeats,
    gathers_at_first_use,
    localize,
    plan_tiles,
    replicate_kv_heads,
)
from ..propagate import Choice, propagate, solve
from ._checks import any_rank, check_same_plan, check_same_schedule, largest_peaks, smallest_over_ranks
from ._plan import Plan, build_plan, timing_line
from ._regions import graph_copy, inline_regions, is_region_joint, outline_blocks, schema_once
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


def _run(name: str, fn: Callable, c: Compile, ctx: SpContext, phase: str, hands_on: tuple[str, ...]) -> None:
    """One pass on ``c``, its time added to the compile's ``phase`` (``Plan.timings``); with
    ``AUTOSP_DEBUG=1`` its time and the graphs it hands on (``c``'s fields ``hands_on``) are logged."""
    t0 = time.perf_counter()
    fn(c, ctx)
    times = _TIMES.get()
    if times is not None:
        times[phase] = times.get(phase, 0.0) + time.perf_counter() - t0
    if os.environ.get("AUTOSP_DEBUG") == "1":
        graphs = [g for g in (getattr(c, f) for f in hands_on) if isinstance(g, fx.GraphModule)]
        log.warning(
            "autosp pass %s: %.3f s%s",
            name,
            time.perf_counter() - t0,
            "".join(f"\n{len(g.graph.nodes)} nodes\n{g.print_readable(print_output=False)}" for g in graphs),
        )


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


@dataclasses.dataclass
class Compile:
    """One compile as the backend's passes hand it on (``TRAINING``, ``FORWARD_ONLY``), each
    filling in its part. ``graph`` is AOTAutograd's joint graph (a forward-only step's forward),
    ``inputs`` its fake inputs as ``localize`` reads a joint graph's (primals, tangents),
    ``outputs`` the forward's outputs, ``kwargs`` the partitioner's other arguments."""

    graph: fx.GraphModule
    inputs: list
    outputs: int
    training: bool
    rank: int  # the sp rank compiling
    kwargs: dict = dataclasses.field(default_factory=dict)
    symbolic: bool = False  # sizes are expressions of the sequence length (``_symbolic``)
    folded: tuple = ()  # K/V heads folded or replicated (notes for the plan)
    planned: fx.GraphModule | None = None  # what planning reads: ``graph``, or its hinted copy
    to_graph: dict | None = None  # on a symbolic length: ``planned``'s nodes -> ``graph``'s
    candidates: object = None  # propagation's strategies per node
    choice: Choice | None = None  # the solver's, on ``planned``
    local_choice: Choice | None = None  # the same on ``graph`` (guarded to even shards)
    plan: Plan | None = None
    tiling: Tiling | None = None
    tile_guard: TileGuard | None = None
    local: fx.GraphModule | None = None  # this rank's per-rank graph (untiled)
    fw: fx.GraphModule | None = None
    bw: fx.GraphModule | None = None
    checkpoint: Checkpoint | None = None
    captured: tuple[str, ...] = ()  # notes of the rewrites of Dynamo's graph (``unchunk``)
    notes: tuple[str, ...] = ()  # the checkpointing pass's notes (a budget's lengths)


def _fold(c: Compile, ctx: SpContext) -> None:
    c.folded += tuple(fold_kv_repeats(c.graph, ctx.n))


def _replicate(c: Compile, ctx: SpContext) -> None:
    c.folded += tuple(replicate_kv_heads(c.graph, ctx))


def _hint(c: Compile, ctx: SpContext) -> None:
    """Planning reads sizes at their hints (a copy of the graph); the per-rank graph stays symbolic."""
    c.symbolic = is_symbolic(c.graph)
    c.planned, c.to_graph = hinted(c.graph) if c.symbolic else (c.graph, None)


def _propagate(c: Compile, ctx: SpContext) -> None:
    c.candidates = propagate(c.planned, ctx)


def _solve(c: Compile, ctx: SpContext) -> None:
    c.choice = solve(c.planned, c.candidates, ctx)


def _on_graph(c: Compile, ctx: SpContext) -> None:
    """The choice on ``graph``'s nodes: on a symbolic length, the hinted copy's mapped back and
    guarded to even shards where the plan relies on them (``guard_even_shards``)."""
    c.local_choice = c.choice
    if c.symbolic:
        strategy = {c.to_graph[nd]: s for nd, s in c.choice.strategy.items()}
        c.local_choice = dataclasses.replace(c.choice, strategy=strategy)
        guard_even_shards(strategy, ctx.n)


def _plan(c: Compile, ctx: SpContext) -> None:
    """The plan ``explain`` shows, the same on every rank (checked)."""
    c.plan = build_plan(c.planned, c.choice, ctx.n, c.folded)
    check_same_plan(c.plan, ctx)


def _tile(c: Compile, ctx: SpContext) -> None:
    """The ops that run in tiles along the sequence, for the tiled rungs (a training step's)."""
    c.tiling, c.tile_guard = plan_tiles(c.planned.graph, c.choice.strategy, ctx, symbolic=c.to_graph)


def _traced(c: Compile, rank: SpContext, tiled: bool = False) -> fx.GraphModule:
    """``rank``'s per-rank graph of ``c`` (in ``c.tiling``'s tiles if ``tiled``: another rank's
    tiles are its own, planned alike)."""
    tiles = None
    if tiled:
        same = rank.rank == c.rank
        tiles = c.tiling if same else plan_tiles(c.planned.graph, c.choice.strategy, rank, symbolic=c.to_graph)[0]
    local = localize(c.graph, c.local_choice, c.inputs, rank, num_fwd_outputs=c.outputs, tiling=tiles)
    return gathers_at_first_use(local)


def per_rank_graph(c: Compile, ctx: SpContext, tiled: bool = False) -> fx.GraphModule:
    """This rank's per-rank graph; on a symbolic length with every rank's guards, its common
    subexpressions merged where every rank's graph merges the same collectives (``rank_graph``)."""
    if not c.symbolic:
        local = _traced(c, ctx, tiled)
    else:
        shape_env = detect_fake_mode(c.inputs).shape_env
        local = rank_graph(functools.partial(_traced, c, tiled=tiled), ctx, shape_env)
    if ctx.n == 1:  # an sp group of one rank: its collectives move nothing
        drop_lone_collectives(local, ctx.group)
    return local


def _localize(c: Compile, ctx: SpContext) -> None:
    c.local = per_rank_graph(c, ctx)
    if ctx.n == 1:
        c.notes += ("an sp group of one rank: its collectives removed (each returns its input)",)


def _checkpoint(c: Compile, ctx: SpContext) -> None:
    """Checkpointing and AOTAutograd's partition into forward and backward (``checkpoint_partition``).
    A symbolic compile's per-rank graph comes merged by ``rank_graph``: the partitioner's own
    merging, rank by rank, may merge a collective on some ranks only."""
    symbolic = c.symbolic
    with functorch_config.patch(cse=not symbolic):
        c.fw, c.bw, c.checkpoint = checkpoint_partition(
            c.local,
            c.inputs,
            ctx.options.checkpoint,
            num_fwd_outputs=c.outputs,
            every_rung=ctx.options.every_rung,
            largest=largest_peaks(ctx),
            smallest=smallest_over_ranks(ctx) if symbolic else None,
            tiled=functools.partial(per_rank_graph, c, ctx, tiled=True) if c.tiling is not None else None,
            tiles=c.tiling.counts if c.tiling is not None else (1, 1),
            offload=ctx.options.offload,
            balance=Balance.of(ctx.options.device),
            **c.kwargs,
        )
    # a symbolic compile serves the lengths that make its tile count only where the count
    # weighed in its checkpointing decision (on any rank: all guard alike, and all exchange)
    if symbolic and any_rank(ctx, "tiles", c.checkpoint.weighs_tiles) and c.tile_guard is not None:
        c.tile_guard.apply()
    c.notes += guard_budget_lengths(c.checkpoint, c.inputs)  # before the lengths note, which reads the guards


def _check_schedule(c: Compile, ctx: SpContext) -> None:
    check_same_schedule(c.fw if c.training else c.local, c.bw, ctx)


def _finish(c: Compile, ctx: SpContext) -> None:
    """The plan with what the compile decided after the solver: its memory and checkpointing, its
    notes, its lengths."""
    notes = c.plan.notes + c.captured
    if not c.training:
        notes += ("forward only (no grad): no checkpointing, no tiling",)
    notes += ((lengths_note(c.inputs),) if c.symbolic else ()) + c.notes
    more = dict(memory=c.checkpoint.memory, checkpoint=c.checkpoint) if c.training else {}
    c.plan = dataclasses.replace(c.plan, notes=notes, **more)


# (name, pass, the compile phase its time counts in (``Plan.timings``), the record's graphs it
# hands on, logged under ``AUTOSP_DEBUG=1``)
_PLANNING = (
    ("fold K/V repeats", _fold, "propagate", ("graph",)),
    ("replicate K/V heads", _replicate, "propagate", ("graph",)),
    ("hint", _hint, "propagate", ()),
    ("propagate", _propagate, "propagate", ()),
    ("solve", _solve, "solve", ()),
    ("plan", _plan, "solve", ()),
)
TRAINING = (
    *_PLANNING,
    ("tile", _tile, "localize", ()),
    ("even shards", _on_graph, "localize", ()),
    ("localize", _localize, "localize", ("local",)),
    ("checkpoint", _checkpoint, "checkpoint", ("fw", "bw")),
    ("check schedule", _check_schedule, "checkpoint", ()),
    ("finish", _finish, "checkpoint", ()),
)
# a graph without a backward (the step under ``torch.no_grad()``: evaluation), planned and
# localized as a training step's forward is, untiled and without checkpointing
FORWARD_ONLY = (
    *_PLANNING,
    ("even shards", _on_graph, "localize", ()),
    ("localize", _localize, "localize", ("local",)),
    ("check schedule", _check_schedule, "localize", ()),
    ("finish", _finish, "localize", ()),
)


def run_passes(passes, c: Compile, ctx: SpContext) -> Compile:
    """``c`` through ``passes`` in order, each timed (``_run``)."""
    for name, fn, phase, hands_on in passes:
        _run(name, fn, c, ctx, phase, hands_on)
    return c


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
    return _Backend(SpContext.of(mesh, options), on_plan, on_run).backend


class _Backend:
    """The backend's state across the compiles of one step: the notes of the rewrites of Dynamo's
    graph (``unchunk``) of the compile under way, and the plan its partition made, which its
    forward's compiled function reports (``on_run``)."""

    def __init__(self, ctx: SpContext, on_plan, on_run):
        self.ctx, self.on_plan, self.on_run = ctx, on_plan, on_run
        self.captured: tuple[str, ...] = ()
        self.planning = False  # the compile under way reached autosp's passes
        self.planned: Plan | None = None  # the partition's plan, until the forward's compile takes it
        self.clock = _Clock(_with_errors(_compiler(ctx.options.compiler)))
        self.compile_joint = aot_autograd(
            fw_compiler=self.fw_compile,
            bw_compiler=self.clock.backward,
            inference_compiler=self.forward_only,
            partition_fn=self.clock.planner(self.partition),
            decompositions=DECOMPOSITIONS,
            keep_inference_input_mutations=True,
        )

    def _planned(self, c: Compile) -> Plan:
        plan = dataclasses.replace(c.plan, timings=self.clock.times)
        self.planned = plan
        if self.on_plan is not None:
            self.on_plan(plan)
        return plan

    def partition(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs, **kwargs):
        if is_region_joint(joint_inputs):  # a repeated block's own: inlined into the step's below
            return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        self.planning = True
        inline_regions(joint)
        c = Compile(joint, joint_inputs, num_fwd_outputs, True, self.ctx.rank, kwargs, captured=self.captured)
        run_passes(TRAINING, c, self.ctx)
        self._planned(c)
        return c.fw, c.bw

    def forward_only(self, graph: fx.GraphModule, example_inputs):
        """A graph without a backward (the step under ``torch.no_grad()``): ``FORWARD_ONLY``."""

        def plan_it(graph, example_inputs):
            self.planning = True
            inline_regions(graph)
            inputs = [list(example_inputs), []]  # (primals, tangents), as localize reads a joint graph's
            outputs = len(graph.graph.output_node().args[0])
            c = Compile(graph, inputs, outputs, False, self.ctx.rank, captured=self.captured)
            run_passes(FORWARD_ONLY, c, self.ctx)
            return c

        c = self.clock.planner(plan_it)(graph, example_inputs)
        self._planned(c)
        run = self.fw_compile(c.local, example_inputs)
        self.clock.done()
        return run

    def fw_compile(self, gm: fx.GraphModule, example_inputs):
        run = self.clock.compile(gm, example_inputs)
        plan, self.planned = self.planned, None  # its partition's, just before
        if self.on_run is None or plan is None:
            return run

        def ran(args):
            self.on_run(plan)
            return run(args)

        ran._boxed_call = True
        return ran

    def backend(self, gm: fx.GraphModule, example_inputs):
        """Dynamo's graph of the step: chunked losses as one (``unchunk``), then AOTAutograd."""
        gm, captured = unchunk(gm)
        self.captured = tuple(captured)
        if self.ctx.options.blocks_once:
            traced = graph_copy(gm.graph)  # to fall back on
            notes = outline_blocks(gm)
            if notes:
                self.captured += notes
                self.planning = False
                try:
                    with schema_once():
                        return self.compile_joint(gm, example_inputs)
                except Exception as e:  # torch's capture of a subgraph, before autosp planned: trace each
                    if self.planning:
                        raise
                    log.warning(
                        "autosp: capturing alike blocks once failed (%s: %s); tracing every block", type(e).__name__, e
                    )
                    self.captured = tuple(captured)
                    gm.graph = traced
                    gm.delete_all_unused_submodules()
        return self.compile_joint(gm, example_inputs)
