"""``autosp.shard``: mark a training step's inputs as sequence-sharded and compile it for the mesh."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from ..backend._backend import Options, make_backend
from ..errors import PlanError
from ..partition._checkpoint import check_policy
from ..propagate._solver import ATTENTION_KERNELS
from ._fsdp import FsdpParams, detach_forward_hooks, find_fsdp
from ._mesh import Mesh, current_mesh
from ._spec import annotate

__all__ = ["shard", "explain", "GraphBreakError"]


class GraphBreakError(PlanError):
    """The step cannot be captured as one graph."""


_SHARDS = "__autosp_fsdp_shards"  # the keyword the step receives FSDP2 shards under

SeqSpec = bool | str | Sequence[str] | Mapping[str, int]


def _seq_dims(seq: SeqSpec, name: str, value: Any) -> int | None:
    if not isinstance(value, torch.Tensor):
        return None
    if seq is True:
        return 1 if value.ndim >= 2 else None
    if seq is False or seq is None:
        return None
    if isinstance(seq, str):
        seq = [seq]
    if isinstance(seq, Mapping):
        return seq.get(name)
    return 1 if name in seq else None


def _map_inputs(fn: Callable, seq: SeqSpec, args, kwargs, mark):
    """Apply ``mark(name, value, seq_dim)`` to every tensor argument that ``seq`` shards."""
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)

    def one(name, value):
        dim = _seq_dims(seq, name, value)
        return value if dim is None else mark(name, value, dim % value.ndim)

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


def _check_inputs(fn: Callable, seq: SeqSpec, n: int, args, kwargs) -> None:
    """Sequence dims need not divide by n (shards are then uneven, balanced), but must exist."""
    def check(name, value, dim):
        if value.ndim <= dim or value.shape[dim] == 0:
            raise PlanError(None, f"input {name!r} of {getattr(fn, '__qualname__', fn)} has shape {tuple(value.shape)}: "
                            f"it has no sequence dim {dim} to shard over sp={n}",
                            "pass a non-empty sequence, or name the sharded inputs and dims with shard(seq=...)")
        return value

    _map_inputs(fn, seq, args, kwargs, check)


def _unwrap_errors(call):
    try:
        return call()
    except torch._dynamo.exc.BackendCompilerFailed as e:
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, (PlanError, _PlanCaptured)):
            raise inner.with_traceback(None) from None
        raise
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
        lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
        frames = [i for i, l in enumerate(lines) if l.startswith("File ") and "/autosp/" not in l]
        where = ""
        if frames:
            i = frames[-1]
            where = " at " + lines[i].replace("File ", "").replace('"', "").replace(", line ", ":")
            where += (": " + lines[i + 1]) if i + 1 < len(lines) else ""
        if "_fully_shard" in str(e):
            raise GraphBreakError(None, f"an FSDP2 module (fully_shard) ran inside the step{where}, but autosp did not "
                                  "find it through the step function, so its hooks broke the graph",
                                  "pass the module to autosp.shard(model), or reach it from the step function's "
                                  "closure, globals or a bound method's object") from None
        raise GraphBreakError(None, f"the step cannot be captured as one graph (graph break){where}: {lines[0]}",
                              "rewrite that line with torch ops (no data-dependent Python control flow, "
                              "no .item()/.tolist(), no print)") from None
    except RuntimeError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise PlanError(None, f"a collective of the sharded step timed out ({str(e).splitlines()[0]})",
                            "every rank of the sp group must run the same steps with the same shapes; "
                            "check for a rank that skipped or changed a step") from e
        raise


class _PlanCaptured(Exception):
    def __init__(self, plan):
        self.plan = plan


class _Sharded:
    """The callable ``shard`` returns: compiles once per mesh and input shapes, then runs."""

    def __init__(self, fn: Callable, seq: SeqSpec, options: Options):
        self.fn, self.seq, self.options = fn, seq, options
        self._compiled: dict[int, Callable] = {}
        self._fsdp_params: dict[int, FsdpParams | None] = {}
        self.plan = None  # the Plan of the latest compile, as autosp.explain shows it
        functools.update_wrapper(self, fn)

    def _record(self, plan) -> None:
        self.plan = plan

    def _step(self, m: Mesh, on_plan=None) -> Callable:
        n = m.sp_size

        fsdp = self._fsdp(m)

        def step(*args, **kwargs):
            shards = kwargs.pop(_SHARDS, None)
            args, kwargs = _map_inputs(self.fn, self.seq, args, kwargs,
                                       lambda name, value, dim: annotate(value, Shard(dim), hard=False))
            if shards is not None:
                return fsdp.call(shards, self.fn, args, kwargs)
            return self.fn(*args, **kwargs)

        # Dynamo caches compiled code per code object, and every _Sharded shares this `step`:
        # a copy per instance keeps their caches apart (else the 9th sharded function would hit
        # the recompile limit and silently run eager, unsharded).
        step.__code__ = step.__code__.replace()
        if n == 1 and m.dp_size == 1 and on_plan is None:
            backend = "inductor" if self.options.compiler == "inductor" else "aot_eager"
        else:
            backend = make_backend(m, self.options, on_plan or self._record)
        return torch.compile(step, backend=backend, fullgraph=True, dynamic=False)

    def _fsdp(self, m: Mesh):
        """The FSDP2 parameters the function reaches (None without), found once per mesh."""
        key = id(m.device_mesh)
        if key not in self._fsdp_params:
            self._fsdp_params[key] = find_fsdp(self.fn, m)
        return self._fsdp_params[key]

    def _run(self, m: Mesh, step: Callable, args, kwargs):
        fsdp = self._fsdp(m)
        if fsdp is None:
            return _unwrap_errors(lambda: step(*args, **kwargs))
        fsdp.check_sync()
        with fsdp.hooks_suspended():
            return _unwrap_errors(lambda: step(*args, **{**kwargs, _SHARDS: fsdp.shards()}))

    def _mesh(self) -> Mesh:
        m = current_mesh()
        if m is None:
            raise RuntimeError("autosp: call the sharded function inside `with autosp.mesh(sp=N):`")
        return m

    def _dp_slice(self, m: Mesh, args, kwargs):
        """Each dp replica takes its slice of the global batch (dim 0 of the sharded inputs)."""
        dp, r = m.dp_size, m.dp_rank

        def cut(name, value, dim):
            if value.requires_grad:
                raise ValueError(f"autosp: input {name!r} requires grad; with dp > 1 only parameters may "
                                 "(its gradient would be a slice of the batch)")
            if dim == 0:
                raise ValueError(f"autosp: input {name!r} has its sequence on dim 0; with dp > 1 dim 0 is the "
                                 "batch that the dp replicas split: put the sequence on dim 1 (or another dim)")
            if value.shape[0] % dp:
                raise ValueError(f"autosp: input {name!r} has shape {tuple(value.shape)}: its batch dim 0 "
                                 f"({value.shape[0]}) must divide by dp={dp}, each dp replica taking an equal "
                                 "slice; pass a global batch that is a multiple of dp")
            return value.tensor_split(dp)[r]

        return _map_inputs(self.fn, self.seq, args, kwargs, cut)

    def __call__(self, *args, **kwargs):
        m = self._mesh()
        _check_inputs(self.fn, self.seq, m.sp_size, args, kwargs)
        if m.dp_size > 1:
            args, kwargs = self._dp_slice(m, args, kwargs)
        key = id(m.device_mesh)
        if key not in self._compiled:
            self._compiled[key] = self._step(m)
        out = self._run(m, self._compiled[key], args, kwargs)
        if m.sp_size * m.dp_size > 1 and self.plan is None and torch.is_grad_enabled():
            raise RuntimeError("autosp: the step ran without the autosp backend (nothing required grad, or Dynamo fell back to eager); "
                               "the results were computed unsharded")
        return out

    def explain(self, *args, **kwargs):
        m = self._mesh()
        _check_inputs(self.fn, self.seq, m.sp_size, args, kwargs)
        if m.dp_size > 1:
            args, kwargs = self._dp_slice(m, args, kwargs)

        def capture(plan):
            raise _PlanCaptured(plan)

        step = self._step(m, on_plan=capture)
        try:
            self._run(m, step, args, kwargs)
        except _PlanCaptured as e:
            return e.plan
        finally:
            torch._dynamo.reset()
        raise RuntimeError("autosp: explain found no backward graph: do the inputs or parameters require grad?")


def shard(fn: Callable | nn.Module | None = None, *, seq: SeqSpec = True, compiler: str = "inductor",
          mem_weight: float = 4.0, checkpoint: str | int = "auto", attention: str = "auto"):
    """Run ``fn`` (a training step returning a loss, or an ``nn.Module``) sequence-parallel on the
    current ``autosp.mesh``.

    seq: which inputs are sharded along their sequence dim: True (dim 1 of every tensor argument
        with ndim >= 2), an argument name or list of names (dim 1), or a mapping name -> dim.
    checkpoint: activation checkpointing: "auto" (the least memory for at most 10% more compute),
        "none", "full" (whole layers recomputed, as per-layer ``torch.utils.checkpoint``), or a
        budget in bytes per rank for the step's peak beyond parameters and optimizer state (the
        fastest plan predicted to fit; an error naming the smallest budget when none does).
    attention: how attention ops run, "auto" (chosen by the plan's cost: Ulysses' all-to-alls
        where the heads split over the ranks, else ring attention), or forced: "ulysses", "ring"
        (K/V passed around the ranks, causal work balanced by a zigzag), "kv_gather" (K/V
        all-gathered), "hybrid" (on ``autosp.mesh(ulysses=u)``: Ulysses within sub-groups of u
        ranks, ring across them). A forced kernel that cannot run an attention op exactly is an
        error.
    Called with full, global tensors (identical on the ranks of an sp group); returns what one
    device would: the global loss on every rank, and after ``backward()`` every parameter's
    ``.grad`` is the single-device gradient on every rank.
    """
    check_policy(checkpoint)
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"autosp: attention={attention!r}; use one of {list(ATTENTION_KERNELS)}")
    options = Options(compiler=compiler, mem_weight=mem_weight, checkpoint=checkpoint, attention=attention)
    if fn is None:
        return functools.partial(shard, seq=seq, compiler=compiler, mem_weight=mem_weight, checkpoint=checkpoint,
                                 attention=attention)
    if isinstance(fn, nn.Module):
        fn.forward = _Sharded(fn.forward, seq, options)
        detach_forward_hooks(fn)
        return fn
    return _Sharded(fn, seq, options)


def explain(fn, *args, **kwargs):
    """The plan for one call of ``fn`` (made by ``autosp.shard``, or a module it wrapped): the
    placement of every node and every inserted collective with its bytes and source line."""
    target = fn.forward if isinstance(fn, nn.Module) else fn
    if not isinstance(target, _Sharded):
        target = _Sharded(target, True, Options(compiler="aot_eager"))
    return target.explain(*args, **kwargs)
