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

_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}
_CURRENT: contextvars.ContextVar["Mesh | None"] = contextvars.ContextVar("autosp_mesh", default=None)


@dataclass(frozen=True, slots=True)
class Mesh:
    """What ``autosp.mesh`` yields: the DTensor device mesh with dims ("dp", "sp"), and this rank's
    place on the sp axis."""

    device_mesh: DeviceMesh

    @property
    def sp_mesh(self) -> DeviceMesh:
        return self.device_mesh["sp"]

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


@contextlib.contextmanager
def mesh(sp: int | None = None, dp: int = 1, *, backend: str | None = None, timeout_s: float = 300.0):
    """Set up the process group (from torchrun's environment, or a world of one) and a
    ``DeviceMesh`` with named dims ("dp", "sp"); ``sp`` defaults to world_size // dp.

    ``timeout_s`` bounds every collective: a rank that never arrives fails the others with
    an error instead of a hang.
    """
    _init_process_group(backend, timeout_s)
    world = dist.get_world_size()
    if sp is None:
        if world % dp:
            raise ValueError(f"autosp: world size {world} is not divisible by dp={dp}; choose dp dividing {world}")
        sp = world // dp
    if sp * dp != world:
        raise ValueError(f"autosp: mesh sp={sp} x dp={dp} = {sp * dp} ranks, but the world has {world}; "
                         f"launch with torchrun --nproc-per-node {sp * dp} or set sp*dp == {world}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    key = (device, dp, sp)
    world_group, cached = _MESHES.get(key, (None, None))
    if world_group is not dist.group.WORLD:  # one DeviceMesh (and its groups) per shape and world
        cached = init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp"))
        _MESHES[key] = (dist.group.WORLD, cached)
    m = Mesh(cached)
    token = _CURRENT.set(m)
    try:
        yield m
    finally:
        _CURRENT.reset(token)
