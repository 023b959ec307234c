"""Partitioning: the per-rank graph, the collectives on its edges, its tiling along the sequence,
the checkpointing decision and the memory it predicts."""

from ._checkpoint import Balance, Checkpoint, Rung, RungSpec, checkpoint_partition
from ._collectives import drop_lone_collectives, redistribute
from ._fsdp import fsdp_notes, gathers_at_first_use
from ._gqa import fold_kv_repeats, replicate_kv_heads
from ._localize import localize
from ._memory import MemoryEstimate
from ._tiling import TileGuard, Tiling, plan_tiles

__all__ = [
    "Balance",
    "Checkpoint",
    "Rung",
    "RungSpec",
    "checkpoint_partition",
    "redistribute",
    "drop_lone_collectives",
    "fsdp_notes",
    "gathers_at_first_use",
    "fold_kv_repeats",
    "replicate_kv_heads",
    "localize",
    "MemoryEstimate",
    "Tiling",
    "TileGuard",
    "plan_tiles",
]
