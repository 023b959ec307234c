"""A sharding strategy, and the registries of rules that produce them.

A rule sees one ATen node and the placements each of its tensor inputs can take (what propagation
reached so far), and returns every strategy that runs the node exactly: one registry of rules
keyed by op overload, in DTensor's shape (``RULES``, filled with ``@rule``). ``PROVENANCE`` holds
correspondences that are not executable strategies but say where the annotated sequence goes
(attention: query positions in, query positions out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement

from .._context import Kernel

__all__ = ["Strategy", "Sets", "RULES", "PROVENANCE", "rule", "provenance", "dedup"]

Sets = Sequence[frozenset]  # per tensor input, the placements it can take


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node: placement of each tensor output (None for non-tensor outputs) and
    the placement each tensor input must be redistributed to (in ``tensor_inputs`` order)."""

    outs: tuple[Placement | None, ...]
    ins: tuple[Placement, ...]
    introduces: bool = False  # may shard dims no input's placement reached (attention heads)
    # attention: how it runs per rank; None for other ops and for running replicated.
    # ``autosp.shard(attention=...)`` forces one
    kernel: Kernel | None = None
    comm: float = 0.0  # bytes a rank sends inside the kernel (ring attention's K/V passes)
    held: float = 0.0  # bytes it holds beyond its inputs and outputs (gathered K/V, saved for the backward)


Rule = Callable[..., list[Strategy]]  # (node, A: Sets, n) -> strategies
RULES: dict[object, Rule] = {}
PROVENANCE: dict[object, Rule] = {}


def rule(*ops) -> Callable[[Rule], Rule]:
    """Register a rule for ``ops``."""

    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return deco


def provenance(*ops) -> Callable[[Rule], Rule]:
    """Register a sequence correspondence for ``ops``, used instead of their rule when tracking
    where the annotated sequence goes."""

    def deco(fn: Rule) -> Rule:
        for op in ops:
            PROVENANCE[op] = fn
        return fn

    return deco


def dedup(strats: Iterable[Strategy]) -> list[Strategy]:
    """The strategies without repeats of the same (outputs, inputs), first occurrence kept."""
    seen, out = set(), []
    for s in strats:
        key = (s.outs, s.ins)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out
