"""What one compile is asked for (``Options``) and where it runs (``SpContext``), and the names of
the per-rank kernels (``Kernel``: attention's, and the halo exchange of a shift). A leaf: every
stage reads these, none writes them."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ._devices import device

__all__ = ["Kernel", "ATTENTION_KERNELS", "ATTENTION_CHOICES", "Options", "SpContext", "check_policy"]


class Kernel(enum.StrEnum):
    """How an op runs per rank when it communicates inside (a strategy's ``kernel``)."""

    ULYSSES = "ulysses"  # heads split over the ranks, all-to-alls around the op
    BATCH = "batch"  # the batch split over the ranks
    KV_GATHER = "kv_gather"  # query sequence-sharded, K/V all-gathered
    RING = "ring"  # query sequence-sharded, K/V chunks passed around the ranks
    HYBRID = "hybrid"  # Ulysses within sub-groups of a 2D sp mesh, ring across them
    HALO = "halo"  # not attention: a shift along the sequence, boundary rows from the neighbours
    MERGE = "merge"  # not attention: a reduction whose per-rank results merge by a formula (logsumexp)
    OWN_ROWS = "own_rows"  # not attention: a scatter to global rows of the sharded dim, into this rank's


ATTENTION_KERNELS = frozenset({Kernel.ULYSSES, Kernel.BATCH, Kernel.KV_GATHER, Kernel.RING, Kernel.HYBRID})


# what ``shard(attention=...)`` accepts: chosen by cost, or one kernel forced
ATTENTION_CHOICES = ("auto", Kernel.ULYSSES.value, Kernel.RING.value, Kernel.KV_GATHER.value, Kernel.HYBRID.value)
CHECKPOINT_POLICIES = ("auto", "none", "full")


def check_policy(policy) -> None:
    if isinstance(policy, bool) or not (policy in CHECKPOINT_POLICIES or (isinstance(policy, int) and policy > 0)):
        raise ValueError(
            f"autosp: checkpoint={policy!r}; use 'auto', 'none', 'full', or a memory budget in bytes "
            "per rank (a positive int)"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """How ``autosp.shard`` compiles; every field is also a keyword of ``shard`` and a key of the
    YAML config's ``shard`` section.

    compiler: "inductor" (default; C++ on CPU, Triton on GPU) or "aot_eager" (no codegen: fast
        compiles, for tests), e.g. ``compiler="aot_eager"``.
    mem_weight: weight of a byte left on a rank against a byte sent, in the plan's objective,
        e.g. ``mem_weight=4.0``.
    checkpoint: activation checkpointing: "auto" (the least memory for at most 10% more compute),
        "none", "full" (whole layers recomputed, as per-layer ``torch.utils.checkpoint``), or a
        budget in bytes per rank for the step's peak beyond parameters and optimizer state (the
        fastest plan predicted to fit), e.g. ``checkpoint=8 * 2**30``.
    attention: how attention ops run: "auto" (by cost: Ulysses' all-to-alls where the heads split
        over the ranks, else ring attention) or a kernel every attention op must run as:
        "ulysses", "ring", "kv_gather" or "hybrid" (on ``autosp.mesh(ulysses=u)``), e.g.
        ``attention="ring"``.
    offload: also weigh checkpointing rungs that keep the layers' saved activations in host memory
        between the forward and the backward (torch's compiled activation offloading): a twin of
        each "full" rung, tiled or not ("full, offloaded"), and under a budget of each "whole
        layers" rung. Under "full" the least device memory takes one; under "auto" one is taken
        where its copies (counted as bytes written twice, at this CPU's balance, not a host
        link's) keep it within the overhead, e.g. ``offload=True``.
    every_rung: evaluate every checkpointing rung, not just until the policy is settled
        (planning tools: ``autosp plan``), e.g. ``every_rung=True``.
    check_inputs: check at every step that the ranks of each sp group were called with the same
        inputs (a fingerprint all-gathered over the group), e.g. ``check_inputs=False``.
    dynamic: capture the step with the sequence lengths symbolic, one compile for every length
        (True, the default; the environment variable ``AUTOSP_DYNAMIC=0`` makes False the
        default), or compile once per length (False), e.g. ``dynamic=False``.
    blocks_once: capture each group of two or more alike repeated blocks (a model's layers) once,
        as ``torch.compiler.nested_compile_region`` would, and plan the step as one graph (True,
        the default); False traces every block (a fallback should torch's subgraph capture fail
        on a model), e.g. ``blocks_once=False``.
    device: the accelerator the step is planned for, one of ``autosp._devices.DEVICES``: the
        checkpointing pass weighs a byte written and a byte copied to the host against a flop
        at its figures (an H100's 295 and 15,450 flop/B) instead of this CPU's 16;
        ``autosp.explain(..., device=...)`` sets it, e.g. ``device="h100"``.
    """

    compiler: str = "inductor"
    mem_weight: float = 4.0
    checkpoint: str | int = "auto"
    attention: str = "auto"
    offload: bool = False
    every_rung: bool = False
    check_inputs: bool = True
    dynamic: bool = field(default_factory=lambda: os.environ.get("AUTOSP_DYNAMIC", "1") != "0")
    blocks_once: bool = True
    device: str | None = None

    def __post_init__(self):
        if self.device is not None:
            device(self.device)  # a clear error for a name not in the table
        if self.compiler not in ("inductor", "aot_eager"):
            raise ValueError(f"autosp: unknown compiler {self.compiler!r}; use 'inductor' or 'aot_eager'")
        check_policy(self.checkpoint)
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"autosp: attention={self.attention!r}; use one of {list(ATTENTION_CHOICES)}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, **kwargs: Any) -> Options:
        """``Options(**kwargs)``, with unknown keywords named in the error."""
        unknown = sorted(set(kwargs) - set(cls.keys()))
        if unknown:
            raise TypeError(f"autosp: unknown option(s) {unknown}; the options are {list(cls.keys())}")
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class SpContext:
    """Where a compile runs: this rank's place on the mesh, the process groups (by name, as
    functional collectives take them), and the options. Built once per compile
    (``SpContext.of``); every pass reads it."""

    options: Options
    n: int  # ranks on the sp axis
    rank: int  # this rank's place on it
    group: str  # the sp process group
    process_group: Any = None  # the same, as a ProcessGroup (cross-rank checks)
    mesh: Any = None  # the sp axis as a DeviceMesh (DTensor's op strategies need one)
    dp: int = 1  # data-parallel replicas
    dp_group: str | None = None
    world_group: str | None = None  # every rank (gradients partial over sp, averaged over dp)
    ulysses: int = 1  # sub-group size of a 2D sp mesh (hybrid attention); 1: none
    inner: str = ""  # the group within a sub-group
    outer: str = ""  # the group across sub-groups

    @classmethod
    def of(cls, mesh, options: Options) -> SpContext:
        """The context of an ``autosp.Mesh`` (this rank's view of it)."""
        import torch.distributed as dist

        inner, outer = mesh.hybrid_groups or ("", "")
        dp = mesh.dp_size
        return cls(
            options=options,
            n=mesh.sp_size,
            rank=mesh.sp_rank,
            group=mesh.sp_group.group_name,
            process_group=mesh.sp_group,
            mesh=mesh.sp_mesh,
            dp=dp,
            dp_group=mesh.dp_group.group_name if dp > 1 else None,
            world_group=dist.group.WORLD.group_name if dp > 1 else None,
            ulysses=mesh.ulysses_size,
            inner=inner,
            outer=outer,
        )
