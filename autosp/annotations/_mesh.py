"""The device mesh: ``autosp.mesh(sp=..., dp=...)`` sets up the process group and the named mesh."""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["Mesh", "mesh", "current_mesh"]

_MESHES: dict[tuple, tuple[object, DeviceMesh, DeviceMesh | None]] = {}
_CURRENT: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("autosp_mesh", default=None)


@dataclass(frozen=True, slots=True)
class Mesh:
    """What ``autosp.mesh`` yields: the DTensor device mesh with dims ("dp", "sp"), and this rank's
    place on the sp axis. With ``ulysses=u`` the sp axis is also a 2D mesh ("ring", "ulysses"):
    sp rank r is member r % u of sub-group r // u."""

    device_mesh: DeviceMesh
    flat_sp: DeviceMesh | None = None  # the sp axis of a 2D sp mesh, flattened ("ring", "ulysses")

    @property
    def ulysses_size(self) -> int:
        """Size of the sp sub-groups hybrid attention runs Ulysses within (1: no 2D sp mesh)."""
        names = self.device_mesh.mesh_dim_names or ()
        return self.device_mesh["ulysses"].size() if "ulysses" in names else 1

    @property
    def hybrid_groups(self) -> tuple[str, str] | None:
        """(group within a sub-group, group across sub-groups) names, or None without a 2D sp mesh."""
        if self.ulysses_size == 1:
            return None
        return self.device_mesh["ulysses"].get_group().group_name, self.device_mesh["ring"].get_group().group_name

    @property
    def sp_mesh(self) -> DeviceMesh:
        return self.flat_sp if self.flat_sp is not None else self.device_mesh["sp"]

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.sp_mesh.get_group()

    @property
    def sp_size(self) -> int:
        return self.sp_mesh.size()

    @property
    def sp_rank(self) -> int:
        return self.sp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.device_mesh["dp"].size()

    @property
    def dp_rank(self) -> int:
        return self.device_mesh["dp"].get_local_rank()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh["dp"].get_group()


def current_mesh() -> Mesh | None:
    return _CURRENT.get()


def _init_process_group(backend: str | None, timeout_s: float) -> None:
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python script.py`: a world of one, so the same script runs both ways
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def mesh(
    sp: int | None = None,
    dp: int = 1,
    *,
    ulysses: int | None = None,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> _MeshScope:
    """Set up the process group (from torchrun's environment, or a world of one) and a
    ``DeviceMesh`` with named dims ("dp", "sp"); ``sp`` defaults to world_size // dp.

    ``ulysses=u`` (dividing sp) also lays the sp axis out as a 2D mesh ("ring" of sp / u,
    "ulysses" of u), for hybrid attention: Ulysses' all-to-alls within each sub-group of u
    consecutive sp ranks (a node's fast links), ring attention across the sub-groups, e.g.
    ``autosp.mesh(sp=16, ulysses=8)`` for 8 K/V heads on 16 ranks.

    ``timeout_s`` bounds every collective: a rank that never arrives fails the others with
    an error instead of a hang.

    The context manager may be entered again (``m = autosp.mesh(sp=2)``, then ``with m:`` in
    each epoch) and decorates a function (``@autosp.mesh(sp=2)``).
    """
    return _MeshScope(sp, dp, ulysses, backend, timeout_s)


class _MeshScope(contextlib.ContextDecorator):
    """What ``autosp.mesh`` returns: each ``with`` sets up (or finds) the mesh and makes it the
    current one until it exits; re-entrant, unlike a generator's context manager, which fails
    on a second ``with`` (``'_GeneratorContextManager' object has no attribute 'args'``)."""

    def __init__(self, *args):
        self._args, self._tokens = args, []

    def __enter__(self) -> Mesh:
        m = _make_mesh(*self._args)
        self._tokens.append(_CURRENT.set(m))
        return m

    def __exit__(self, *exc) -> bool:
        _CURRENT.reset(self._tokens.pop())
        return False


def _make_mesh(sp: int | None, dp: int, ulysses: int | None, backend: str | None, timeout_s: float) -> Mesh:
    _init_process_group(backend, timeout_s)
    world = dist.get_world_size()
    if sp is None:
        if world % dp:
            raise ValueError(f"autosp: world size {world} is not divisible by dp={dp}; choose dp dividing {world}")
        sp = world // dp
    if sp * dp != world:
        raise ValueError(
            f"autosp: mesh sp={sp} x dp={dp} = {sp * dp} ranks, but the world has {world}; "
            f"launch with torchrun --nproc-per-node {sp * dp} or set sp*dp == {world}"
        )
    if ulysses is not None and not (1 < ulysses < sp and sp % ulysses == 0):
        raise ValueError(
            f"autosp: ulysses={ulysses} must divide sp={sp} and lie strictly between 1 and sp "
            "(the size of the sub-groups attention runs Ulysses within; ring across them)"
        )
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    key = (device, dp, sp, ulysses)
    world_group, cached, flat = _MESHES.get(key, (None, None, None))
    if world_group is not dist.group.WORLD:  # one DeviceMesh (and its groups) per shape and world
        if ulysses is None:
            cached, flat = init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp")), None
        else:
            cached = init_device_mesh(device, (dp, sp // ulysses, ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
            flat = cached["ring", "ulysses"]._flatten("sp")
        _MESHES[key] = (dist.group.WORLD, cached, flat)
    return Mesh(cached, flat)
