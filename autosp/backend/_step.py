"""The runtime of a sharded step: ``ShardedStep`` (what ``autosp.shard`` returns) checks that the
ranks of the sp group hold the same inputs, marks the sharded ones, compiles once per mesh with
the autosp backend, hands FSDP2's shards to the graph, and turns torch's failures into autosp's
errors. With dp > 1 each rank is called with its own dp replica's batch (DDP's convention)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.utils._pytree import MappingKey, keystr, tree_flatten, tree_flatten_with_path, tree_map_with_path

from .._context import Options
from ..errors import GraphBreakError, PlanError, RecompileLimitError, collective_error, user_frame
from ..propagate._annotate import annotate_placement
from ._backend import CALL_STARTED, make_backend
from ._block_masks import block_mask_inputs, rebuilt
from ._experts import capture_hf_experts
from ._fsdp import FsdpParams, find_fsdp
from ._inputs import check_same_inputs

log = logging.getLogger("autosp")

__all__ = ["ShardedStep", "SeqSpec"]

_SHARDS = "__autosp_fsdp_shards"  # the keyword the step receives FSDP2 shards under

SeqSpec = bool | str | Sequence[str] | Mapping[str, int]


def seq_names(seq: Any) -> tuple[str, ...]:
    """The argument names a ``seq`` spec names (none for True / False), or a TypeError naming the
    spec's kinds, for a spec of any other kind (a tuple of flags would otherwise shard nothing)."""
    if seq is True or seq is False or seq is None:
        return ()
    if isinstance(seq, str):
        return (seq,)
    if isinstance(seq, Mapping):
        if all(isinstance(k, str) for k in seq) and all(
            isinstance(d, int) and not isinstance(d, bool) for d in seq.values()
        ):
            return tuple(seq)
    elif isinstance(seq, (Sequence, set, frozenset)) and all(isinstance(k, str) for k in seq):
        return tuple(seq)
    raise TypeError(
        f"autosp: shard(seq={seq!r}): seq takes True (dim 1 of every tensor argument), an argument name, a "
        "list of names (dim 1 of each) or a mapping name -> dim, e.g. seq=['input_ids', 'labels'] or "
        "seq={'input_ids': 1}; name positional arguments by their parameter names"
    )


def _seq_dim(seq: SeqSpec, names: tuple[str, ...], value: Any) -> int | None:
    """The sharded dim of ``value`` under ``seq``; ``names``: the argument's name, then the dict
    keys leading to ``value`` inside it (innermost first), any of which ``seq`` may name."""
    if not isinstance(value, torch.Tensor):
        return None
    if seq is True:
        return 1 if value.ndim >= 2 else None
    if seq is False or seq is None:
        return None
    if isinstance(seq, str):
        seq = [seq]
    if isinstance(seq, Mapping):
        return next((seq[n] for n in names if n in seq), None)
    return 1 if any(n in seq for n in names) else None


def _bound(fn: Callable, args, kwargs) -> tuple[inspect.Signature, inspect.BoundArguments]:
    sig = inspect.signature(fn)
    return sig, sig.bind(*args, **kwargs)


def _map_inputs(fn: Callable, seq: SeqSpec, args, kwargs, mark):
    """Apply ``mark(name, value, seq_dim)`` to every tensor argument that ``seq`` shards, and to
    every tensor inside an argument that is a container (a dict batch: its keys are names too)."""
    sig, bound = _bound(fn, args, kwargs)

    def one(name, value):
        def leaf(path, x):
            keys = [k.key for k in reversed(path) if isinstance(k, MappingKey) and isinstance(k.key, str)]
            dim = _seq_dim(seq, (*keys, name), x)
            if dim is None:
                return x
            # out of range, it goes to mark as it is: _check_inputs, which runs first, refuses it
            return mark(name + keystr(path), x, dim % x.ndim if -x.ndim <= dim < x.ndim else dim)

        if isinstance(value, torch.Tensor):
            return leaf((), value)
        return tree_map_with_path(leaf, value)

    for name, param in sig.parameters.items():
        if name not in bound.arguments:
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            bound.arguments[name] = {k: one(k, v) for k, v in bound.arguments[name].items()}
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            bound.arguments[name] = tuple(one(f"{name}[{i}]", v) for i, v in enumerate(bound.arguments[name]))
        else:
            bound.arguments[name] = one(name, bound.arguments[name])
    return bound.args, bound.kwargs


def _named_tensors(fn: Callable, args, kwargs) -> list[tuple[str, torch.Tensor]]:
    """Every tensor among the arguments, named by its parameter (and position inside it)."""
    out = []
    for name, value in inspect.signature(fn).bind(*args, **kwargs).arguments.items():
        leaves, _ = tree_flatten(value)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        out += [(name if len(tensors) == 1 else f"{name}[{i}]", t) for i, t in enumerate(tensors)]
    return out


def _check_inputs(fn: Callable, seq: SeqSpec, n: int, args, kwargs) -> None:
    """Sequence dims need not divide by n (shards are then uneven, balanced), but must exist; a
    name in ``seq`` must be an argument (or a key of a dict argument), and with n > 1 the call
    must shard some input: else the step would run whole on every rank, with no error."""
    sharded: list[str] = []

    def check(name, value, dim):
        if not 0 <= dim < value.ndim or value.shape[dim] == 0:
            raise PlanError(
                None,
                f"input {name!r} of {getattr(fn, '__qualname__', fn)} has shape {tuple(value.shape)}: "
                f"it has no sequence dim {dim} to shard over sp={n}",
                "pass a non-empty sequence, or name the sharded inputs and dims with shard(seq=...)",
            )
        sharded.append(name)
        return value

    _map_inputs(fn, seq, args, kwargs, check)
    sig, bound = _bound(fn, args, kwargs)
    known = set(sig.parameters)
    for name, value in bound.arguments.items():
        known.update(k.key for path, _ in tree_flatten_with_path(value)[0] for k in path if isinstance(k, MappingKey))
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            known.update(value)
    where = getattr(fn, "__qualname__", type(fn).__name__)
    unknown = [k for k in seq_names(seq) if k not in known]
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    if unknown and not (takes_kwargs and sharded):
        raise ValueError(
            f"autosp: shard(seq={seq!r}) names {unknown}: no argument of {where} this call (its arguments: "
            f"{sorted(bound.arguments)}), nor a key of a dict argument; name the arguments (or keys) to shard"
        )
    if n > 1 and not sharded:
        shapes = {name: tuple(t.shape) for name, t in _named_tensors(fn, args, kwargs)}
        raise ValueError(
            f"autosp: shard(seq={seq!r}) shards no input of {where} (its tensors: {shapes}), so every rank "
            "would run the whole step; pass the sequence-shaped inputs (dim 1, or name them and their dims "
            "with seq={'name': dim})"
        )


def _graph_break(e: Exception) -> GraphBreakError:
    where = user_frame(str(e))
    where = f" at {where}" if where else ""
    first = next((line.strip() for line in str(e).strip().splitlines() if line.strip()), "")
    if "_fully_shard" in str(e):
        return GraphBreakError(
            None,
            f"an FSDP2 module (fully_shard) ran inside the step{where}, but autosp did not "
            "find it through the step function, so its hooks broke the graph",
            "pass the module to autosp.shard(model), or reach it from the step function's "
            "closure, globals or a bound method's object",
        )
    disabled = re.search(r"Skip calling function `<function ([\w.<>]+) at .*torch\.compiler\.disable", str(e))
    if disabled:
        name = disabled.group(1)
        return GraphBreakError(
            None,
            f"the step calls {name}, which is wrapped with torch.compiler.disable: Dynamo skips it, a graph "
            f"break{where}",
            f"call what {name} computes without the decorator inside the step (its __wrapped__, or the same "
            "torch ops), or call it outside the step: autosp captures the step as one graph",
        )
    if "torch.utils.checkpoint" in str(e):
        return GraphBreakError(
            None,
            f"the step runs torch.utils.checkpoint, inside which a side effect cannot be captured as "
            f"one graph{where}: {first} (Hugging Face models: gradient_checkpointing_enable(), whose "
            "hub-kernel wrappers set Python state in every attention forward)",
            "drop torch.utils.checkpoint from the model (model.gradient_checkpointing_disable()); autosp "
            "recomputes on the joint graph itself: shard(checkpoint='full') recomputes whole layers, as it did",
        )
    return GraphBreakError(
        None,
        f"the step cannot be captured as one graph (graph break){where}: {first}",
        "rewrite that line with torch ops (no data-dependent Python control flow, no .item()/.tolist(), no print)",
    )


_RAISED = re.compile(r"raised exception (NotImplementedError|ValueError)\((['\"])(autosp: .*?)\2\)", re.S)
_RAISED_TYPES = {"NotImplementedError": NotImplementedError, "ValueError": ValueError}


def _raised_in_step(e: Exception) -> Exception | None:
    """An autosp error raised while Dynamo traced the step (``gpu_attention``'s choice of a GPU
    kernel), which Dynamo reports as a graph break ("Observed exception", the error's repr in its
    cause): the error itself, for the user to read."""
    while e is not None:
        found = _RAISED.search(str(e))
        if found:
            return _RAISED_TYPES[found.group(1)](found.group(3))
        e = e.__cause__ or e.__context__
    return None


def _recompile_limit() -> RecompileLimitError:
    reasons = [str(r) for rs in torch._dynamo.utils.guard_failures.values() for r in rs]
    last = f" (the last time: {reasons[-1].strip().splitlines()[0]})" if reasons else ""
    return RecompileLimitError(
        None,
        f"the step recompiled {torch._dynamo.config.recompile_limit} times for the same input "
        f"shapes{last}: Dynamo's recompile_limit; a Python value the step reads changes between "
        "calls",
        "pass the changing value as a tensor, or keep it fixed; or raise torch._dynamo.config.recompile_limit",
    )


def _unwrap_errors(call):
    try:
        return call()
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        raise _recompile_limit() from None
    except torch._dynamo.exc.BackendCompilerFailed as e:
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, (PlanError, _PlanCaptured)):
            raise inner.with_traceback(None) from None
        raise
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
        raise (_raised_in_step(e) or _graph_break(e)) from None
    except RuntimeError as e:
        error = collective_error(e)
        if error is not None:
            raise error from e
        raise


class _PlanCaptured(Exception):
    def __init__(self, plan):
        self.plan = plan


# compiled steps kept per sharded function, one per mesh and input shapes; the least recently
# used goes first (a length seen again after that compiles again)
MAX_COMPILED = 16


def _shapes(named: list[tuple[str, torch.Tensor]], symbolic: dict[int, int] | None = None) -> tuple:
    """The input shapes a compiled step serves: each sharded dim of a symbolic compile (``symbolic``:
    the id of its input -> the dim) as "S"."""
    out = []
    for name, t in named:
        shape = list(t.shape)
        d = (symbolic or {}).get(id(t))
        if d is not None:
            shape[d] = "S"
        out.append((name, tuple(shape), t.dtype))
    return tuple(out)


def _changed(before: tuple, after: tuple) -> str:
    return ", ".join(f"{a[0]} {a[1]} -> {b[1]}" for a, b in zip(before, after) if a != b) or str(after)


class ShardedStep:
    """The callable ``autosp.shard`` returns: compiles once per mesh and input shapes, then runs.
    ``mesh``: returns the current ``autosp.Mesh`` (or None outside one).

    With ``dynamic=True`` (the default) the sharded dims are symbolic: one compiled step serves
    every length (``backend._symbolic``). Dynamo compiles it again only where the plan makes a
    choice by the length, and then once per choice, not per length: the number of tiles along
    the sequence (1, 2, 4 or 8) where the checkpointing pass weighs tiled rungs, and lengths
    that divide by the ranks when the first did (``backend._symbolic.guard_even_shards``).
    Other shapes (the batch, a dtype) and ``dynamic=False`` compile once per shape: a
    ``torch.compile`` of its own copy of the step's code each, so new shapes never reach Dynamo's
    recompile limit; each new one is logged once, with what changed."""

    def __init__(self, fn: Callable, seq: SeqSpec, options: Options, mesh: Callable[[], Any]):
        seq_names(seq)
        self.fn, self.seq, self.options, self._current_mesh = fn, seq, options, mesh
        self._compiled: collections.OrderedDict[tuple, Callable] = collections.OrderedDict()
        self._fsdp_params: dict[int, FsdpParams | None] = {}
        self.plan = None  # the Plan of the compile the latest call ran, as autosp.explain shows it
        functools.update_wrapper(self, fn)

    def _record(self, plan) -> None:
        self.plan = plan

    def with_options(self, **changes) -> ShardedStep:
        """The same step with some options changed, compiled on its own."""
        return ShardedStep(self.fn, self.seq, dataclasses.replace(self.options, **changes), self._current_mesh)

    def _compiled_for(self, m, key: tuple, dynamic: bool) -> Callable:
        """The compiled step for ``key`` (mesh, input shapes), compiled on first use."""
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        before = next((k for k in reversed(self._compiled) if k[0] == key[0]), None)
        if before is not None:
            log.warning("autosp: new input shapes (%s): compiling the step for them", _changed(before[1], key[1]))
        self._compiled[key] = step = self._step(m, dynamic=dynamic, compiled=self._compiled_again())
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return step

    def _compiled_again(self) -> Callable:
        """``on_plan`` of a step's compiles: from the second on (Dynamo compiling the step again for
        shapes its guards refused: a symbolic step's choice by the length), each logged once, with
        the guard that failed and the lengths the new compile serves."""
        plans = []

        def compiled(plan, code) -> None:
            plans.append(plan)
            if len(plans) > 1:
                failed = torch._dynamo.utils.guard_failures.get(code) or ["?"]
                lengths = [x for x in plan.notes if x.startswith("symbolic sequence length")]
                log.warning(
                    "autosp: compiling the step again (Dynamo's guard %s failed)%s",
                    str(failed[-1]).strip().splitlines()[0],
                    f"; {lengths[0]}" if lengths else "",
                )

        return compiled

    def _step(self, m, on_plan=None, dynamic: bool = False, compiled=None) -> Callable:
        """The compiled step; ``on_plan`` is handed each compile's plan (explain), else each call
        records the plan of the compile it runs; ``dynamic``: the marked dims symbolic;
        ``compiled(plan, code)``: called at each compile."""
        fsdp = self._fsdp(m)

        def step(*args, **kwargs):
            shards = kwargs.pop(_SHARDS, None)
            args, kwargs = rebuilt(args, kwargs)  # block masks passed on a symbolic length
            args, kwargs = _map_inputs(
                self.fn, self.seq, args, kwargs, lambda name, value, dim: annotate_placement(value, Shard(dim), False)
            )
            if shards is not None:
                return fsdp.call(shards, self.fn, args, kwargs)
            return self.fn(*args, **kwargs)

        # Dynamo caches compiled code per code object, and every ShardedStep shares this `step`:
        # a copy per compiled step (sharded function and input shapes) keeps their caches apart
        # (else the 9th sharded function, or length, would hit the recompile limit).
        step.__code__ = step.__code__.replace()
        # a world of one (``python train.py`` on one GPU) runs the same passes as a larger mesh:
        # checkpointing, tiling and offload, its sp group's collectives removed (``_localize``)
        if on_plan is None and compiled is not None:
            on_plan = functools.partial(compiled, code=step.__code__)
        backend = make_backend(m, self.options, on_plan, on_run=self._record)
        capture_hf_experts()
        return torch.compile(step, backend=backend, fullgraph=True, dynamic=None if dynamic else False)

    def _symbolic_inputs(self, args, kwargs) -> tuple[tuple, dict, dict[int, int]]:
        """The inputs, each sharded one as an alias with its sharded dim marked dynamic (the
        caller's tensors stay unmarked; a FlexAttention block mask's lengths too:
        ``_block_masks``), and the alias ids -> their dims."""
        marked: dict[int, int] = {}

        def mark(name, value, dim):
            alias = value.view_as(value)
            torch._dynamo.maybe_mark_dynamic(alias, dim)
            marked[id(alias)] = dim
            return alias

        args, kwargs = _map_inputs(self.fn, self.seq, args, kwargs, mark)
        args, kwargs = block_mask_inputs(args, kwargs)  # FlexAttention's, lengths symbolic too
        return args, kwargs, marked

    def _fsdp(self, m):
        """The FSDP2 parameters the function reaches (None without), found once per mesh."""
        key = id(m.device_mesh)
        if key not in self._fsdp_params:
            self._fsdp_params[key] = find_fsdp(self.fn, m)
        return self._fsdp_params[key]

    def _run(self, m, step: Callable, args, kwargs):
        fsdp = self._fsdp(m)
        token = CALL_STARTED.set(time.perf_counter())  # a compile's capture is timed from here
        try:
            return self._call(fsdp, step, args, kwargs)
        finally:
            CALL_STARTED.reset(token)

    @staticmethod
    def _call(fsdp, step: Callable, args, kwargs):
        # only the marked dims are symbolic: Dynamo's automatic dynamic shapes would make others so
        # after a recompile, from a profile it keys by the code's name and line, which every copy
        # of the step shares (so one step's shapes would make another's batch dim symbolic)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            if fsdp is None:
                return _unwrap_errors(lambda: step(*args, **kwargs))
            fsdp.check_sync()
            with fsdp.hooks_suspended():
                return _unwrap_errors(lambda: step(*args, **{**kwargs, _SHARDS: fsdp.shards()}))

    def _mesh(self):
        m = self._current_mesh()
        if m is None:
            raise RuntimeError("autosp: call the sharded function inside `with autosp.mesh(sp=N):`")
        return m

    def _prepared(self, args, kwargs):
        """The current mesh, with the inputs checked."""
        m = self._mesh()
        _check_inputs(self.fn, self.seq, m.sp_size, args, kwargs)
        if m.dp_size > 1:
            for name, value in _named_tensors(self.fn, args, kwargs):
                if value.requires_grad:
                    raise ValueError(
                        f"autosp: input {name!r} requires grad; with dp > 1 only parameters may (the gradients "
                        "are averaged over the dp replicas, which each have inputs of their own)"
                    )
        return m

    def __call__(self, *args, **kwargs):
        m = self._prepared(args, kwargs)
        marked = {}
        if self.options.dynamic:
            args, kwargs, marked = self._symbolic_inputs(args, kwargs)
        named = _named_tensors(self.fn, args, kwargs)
        if self.options.check_inputs and m.sp_size > 1 and dist.get_backend(m.sp_group) != "fake":
            check_same_inputs(named, m.device_mesh.mesh.reshape(m.dp_size, -1).tolist())
        step = self._compiled_for(m, (id(m.device_mesh), _shapes(named, marked)), bool(marked))
        self.plan = None
        out = self._run(m, step, args, kwargs)
        if m.sp_size * m.dp_size > 1 and self.plan is None:  # with or without grad: both are planned
            raise RuntimeError(
                "autosp: the step ran without the autosp backend (Dynamo fell back to eager); the "
                "results were computed unsharded"
            )
        return out

    def explain(self, *args, **kwargs):
        """The plan of one call, without running the step (see ``autosp.explain``): the plan the
        call's compile makes, at the call's lengths."""
        m = self._prepared(args, kwargs)

        def capture(plan):
            raise _PlanCaptured(plan)

        marked = {}
        if self.options.dynamic:
            args, kwargs, marked = self._symbolic_inputs(args, kwargs)
        try:
            self._run(m, self._step(m, on_plan=capture, dynamic=bool(marked)), args, kwargs)
        except _PlanCaptured as e:
            return e.plan
        finally:
            torch._dynamo.reset()
        raise RuntimeError("autosp: explain found no backward graph: do the inputs or parameters require grad?")
