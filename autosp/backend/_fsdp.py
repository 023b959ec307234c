"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under ``autosp.shard``: ZeRO-3 semantics inside
the captured step.

FSDP2 runs its all-gathers and reduce-scatters from module hooks that Dynamo does not trace (they
are ``torch._dynamo.disable``d), so a ``fullgraph`` capture of an FSDP model breaks. autosp takes
the parameter traffic over instead, as SimpleFSDP does: the step receives each parameter's local
shard (``DTensor.to_local()``, so gradients land in the sharded ``.grad`` as FSDP2 leaves them),
gathers it in the graph (``autosp::fsdp_gather``) and runs the user's function with the module's
parameters swapped for the gathered ones; FSDP2's forward hooks are suspended for the call. The
optimizer then steps the sharded parameters, so its state is sharded too.

With FSDP2's ``CPUOffloadPolicy`` the shards live in host memory: the step copies each to the
device it is gathered on, in the graph, and the copy's gradient lands in the shard's ``.grad`` on
the host, where the optimizer steps it (FSDP2's offload: parameters, gradients and optimizer state
on the host). The plan's memory still counts those shards and gradients as device bytes
(``autosp plan --cpu-offload`` places them on the host).

The FSDP group may be the dp group, the sp group (with the autosp mesh itself given to
``fully_shard``: HSDP, replicated over dp) or every rank. Gradients are what the step's contract
says (the sum over sp of the partial gradients, averaged over the dp replicas), each rank keeping
its shard.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.utils.stateless import _reparametrize_module

from ..partition._fsdp import GatherArgs, fsdp_gather

__all__ = ["FsdpParams", "find_fsdp", "detach_forward_hooks"]

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _candidates(fn) -> list[nn.Module]:
    """The modules a step function can reach without tracing it: the function itself, a bound
    method's object, functools.partial arguments, closure cells, the globals its code names, and
    one level of attributes of those objects (``self.model``)."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def add(obj, depth: int) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            out.append(obj)
        elif isinstance(obj, functools.partial):
            for a in (obj.func, *obj.args, *obj.keywords.values()):
                add(a, depth)
        elif callable(obj) and hasattr(obj, "__code__"):
            if getattr(obj, "__self__", None) is not None:
                add(obj.__self__, depth)
            f = getattr(obj, "__func__", obj)
            if not isinstance(f, types.FunctionType):  # a wrapper that only looks like one
                # (torch.compiler.disable's: its class's __closure__ slot is no tuple)
                return
            for cell in f.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    add(cell.cell_contents, depth)
            for name in f.__code__.co_names:
                if name in f.__globals__:
                    add(f.__globals__[name], depth)
        elif depth == 0 and hasattr(obj, "__dict__") and not isinstance(obj, type):
            for v in vars(obj).values():
                add(v, 1)
        elif isinstance(obj, (list, tuple, dict)) and depth == 0:
            for v in obj.values() if isinstance(obj, dict) else obj:
                add(v, 1)

    add(fn, 0)
    return out


def _ranks(group) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(group)))


@dataclass(frozen=True)
class _Param:
    param: DTensor
    args: GatherArgs
    # FSDP2's ``CPUOffloadPolicy``: the shard lives in host memory and is gathered on this
    # device (its gradient lands back on the host); None: it lives where it is gathered
    device: torch.device | None = None


@dataclass(frozen=True)
class FsdpParams:
    """The FSDP2-managed parameters a step uses: per top-level FSDP module, the names (relative to
    it) of its sharded parameters, and each parameter's gather arguments."""

    tops: tuple[nn.Module, ...]
    params: tuple[_Param, ...]
    names: tuple[tuple[tuple[str, ...], ...], ...]  # per top module, per param: its names there (none: ())
    states: tuple

    def shards(self) -> list[torch.Tensor]:
        return [p.param.to_local() for p in self.params]

    def call(self, shards, fn, args, kwargs):
        """``fn(*args, **kwargs)`` with the modules' parameters gathered from ``shards`` (traced)."""
        fulls = [fsdp_gather(_on(s, p.device), **p.args._asdict()) for s, p in zip(shards, self.params)]

        def run(i: int):
            if i == len(self.tops):
                return fn(*args, **kwargs)
            swap = {name: full for names, full in zip(self.names[i], fulls) for name in names}
            with _reparametrize_module(self.tops[i], swap):
                return run(i + 1)

        return run(0)

    def check_sync(self) -> None:
        """Every step reduces its gradients: refuse FSDP2's accumulate-without-reducing mode
        rather than silently reducing anyway."""
        for st in self.states:
            if any(not pg.reduce_grads for pg in st._fsdp_param_groups):
                raise ValueError(
                    "autosp: an FSDP2 module has set_requires_gradient_sync(False); autosp reduces "
                    "every step's gradients into their shards (gradients accumulate there across "
                    "backward calls): call set_requires_gradient_sync(True)"
                )

    @contextlib.contextmanager
    def hooks_suspended(self):
        """FSDP2's forward hooks (unshard, reshard, backward registration) off for the call."""
        saved = []
        for st in self.states:
            ids = {h.id for h in _hook_handles(st)}
            for mod in st._modules:
                for attr in _HOOK_DICTS:
                    d = getattr(mod, attr)
                    if any(k in d for k in ids):
                        saved.append((d, dict(d)))
                        for k in ids:
                            d.pop(k, None)
        try:
            yield
        finally:
            for d, copy in saved:
                d.clear()
                d.update(copy)


def _on(shard: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A host shard (FSDP2's ``CPUOffloadPolicy``) copied to the device it is gathered on, in the
    graph, as FSDP2 copies it before its all-gather; the copy's gradient is the device gradient
    copied back, so the shard's ``.grad`` is on the host, where FSDP2's offload leaves it and the
    optimizer steps it."""
    if device is None or shard.device == device:
        return shard
    return shard.to(device, non_blocking=True)


def _hook_handles(state) -> list:
    """The removable handles of an FSDP2 state's forward hooks (a grouped state nests them)."""
    out, stack = [], [state._pre_forward_hook_handle, state._post_forward_hook_handle]
    while stack:
        h = stack.pop()
        if hasattr(h, "handles"):
            stack.extend(h.handles)
        elif hasattr(h, "id"):
            out.append(h)
    return out


def detach_forward_hooks(module: nn.Module) -> None:
    """``autosp.shard(model)`` on an FSDP2 module: its own forward hooks would run (eagerly, an
    all-gather of its parameters) before the sharded forward that replaces them; remove them."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        for h in _hook_handles(module._get_fsdp_state()):
            h.remove()


def _fsdp_error(name: str, what: str, fix: str) -> ValueError:
    return ValueError(f"autosp: FSDP2 parameter {name!r} {what}; {fix}")


def _check(name: str, p: DTensor, mp) -> int:
    """The mesh dim FSDP2 shards parameter ``p`` over; an error for what autosp does not run."""
    if mp.output_dtype is not None:
        raise _fsdp_error(
            name,
            f"has a mixed-precision policy with output_dtype ({mp})",
            "autosp runs FSDP2's param_dtype and reduce_dtype but casts no module "
            "outputs: drop output_dtype and cast where the model needs it",
        )
    shard_dims = [i for i, q in enumerate(p.placements) if isinstance(q, Shard)]
    if (
        len(shard_dims) != 1
        or type(p.placements[shard_dims[0]]) is not Shard
        or any(not isinstance(q, (Shard, Replicate)) for q in p.placements)
    ):
        raise _fsdp_error(
            name,
            f"has placements {p.placements} on {p.device_mesh}",
            "autosp composes with FSDP2 sharding over one mesh dim (Shard(d)), optionally "
            "replicated over another (HSDP)",
        )
    return shard_dims[0]


def _outer(name: str, ranks: tuple[int, ...], mesh) -> str:
    """The group holding the same shard as this rank (the gradient is all-reduced over it after
    the reduce-scatter): none when FSDP shards over every rank, sp when over dp, dp when over sp."""
    dp_ranks, sp_ranks = _ranks(mesh.dp_group), _ranks(mesh.sp_group)
    if ranks == tuple(range(dist.get_world_size())):
        return ""
    if ranks == dp_ranks:
        return mesh.sp_group.group_name if mesh.sp_size > 1 else ""
    if ranks == sp_ranks:
        return mesh.dp_group.group_name if mesh.dp_size > 1 else ""
    raise _fsdp_error(
        name,
        f"is sharded over ranks {list(ranks)}, which are neither the autosp mesh's "
        f"dp group {list(dp_ranks)}, its sp group {list(sp_ranks)} nor every rank",
        "pass fully_shard(mesh=m.device_mesh['dp']), m.device_mesh['sp'], "
        "m.device_mesh (HSDP: sharded over sp, replicated over dp) or a mesh of "
        "every rank",
    )


def _gather_args(fp, mp, mesh, reshard: bool) -> GatherArgs:
    p = fp.sharded_param
    name = f"{type(fp._module_info.module).__name__}.{fp._module_info.param_name}"
    i = _check(name, p, mp)
    group = p.device_mesh.get_group(i)
    ranks = _ranks(group)
    d = p.placements[i].dim
    dtype = mp.param_dtype or p.dtype
    return GatherArgs(
        dim=d,
        size=p.shape[d],
        world=len(ranks),
        outer=_outer(name, ranks, mesh),
        divide=mesh.dp_size,
        reshard=reshard,
        dtype=dtype,
        reduce_dtype=mp.reduce_dtype or dtype,
        group=group.group_name,
    )


def _offloaded_to(fp, pg) -> torch.device | None:
    """The device an FSDP2 parameter offloaded to the host (``CPUOffloadPolicy``) is gathered on
    (its param group's), or None where it is not offloaded."""
    if not getattr(fp, "offload_to_cpu", False):
        return None
    return torch.device(pg.device)


def find_fsdp(fn, mesh) -> FsdpParams | None:
    """The FSDP2 parameters ``fn`` reaches (see ``_candidates``), or None without any."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = []
    for root in _candidates(fn):
        for mod in root.modules():
            if isinstance(mod, FSDPModule) and all(mod is not f for f in fsdp):
                fsdp.append(mod)
    if not fsdp:
        return None
    inside = {id(sub) for f in fsdp for sub in f.modules() if sub is not f}
    tops = tuple(f for f in fsdp if id(f) not in inside)
    params: list[_Param] = []
    seen: set[int] = set()
    states = [mod._get_fsdp_state() for mod in fsdp]
    for mod, st in zip(fsdp, states):
        for pg in st._fsdp_param_groups:
            reshard = pg.post_forward_mesh_info is not None and not (st._auto_reshard_after_forward and mod in tops)
            for fp in pg.fsdp_params:
                if id(fp.sharded_param) not in seen:
                    seen.add(id(fp.sharded_param))
                    args = _gather_args(fp, st._mp_policy, mesh, reshard)
                    params.append(_Param(fp.sharded_param, args, _offloaded_to(fp, pg)))
    names = []
    for top in tops:
        by_id: dict[int, list[str]] = {}
        for n, q in top.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(q), []).append(n)
        names.append(tuple(tuple(by_id.get(id(p.param), ())) for p in params))
    return FsdpParams(tops, tuple(params), tuple(names), tuple(states))
