"""The plan ``autosp.explain`` returns: every node's placement and every inserted collective."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .._context import Kernel
from .._graph import is_attention_backward, nbytes, out_vals, tensor_inputs
from ..errors import source_line
from ..partition._checkpoint import Checkpoint
from ..partition._fsdp import fsdp_notes
from ..partition._memory import MemoryEstimate
from ..propagate._attention import attention_notes
from ..propagate._placement import R, redistribute_kind, transfer_bytes
from ..propagate._solver import Choice

__all__ = ["Collective", "Plan", "build_plan"]


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective on the sp axis. ``bytes_per_rank`` is what each rank sends (ring model)."""

    kind: str
    src: str
    dst: str
    shape: tuple[int, ...]
    dtype: str
    bytes_per_rank: float
    producer: str
    consumer: str
    op: str
    source: str
    backward: bool


@dataclass(frozen=True, slots=True)
class Plan:
    sp: int
    placements: dict[str, tuple[str, ...]]
    collectives: tuple[Collective, ...]
    mem_bytes: float
    notes: tuple[str, ...] = ()  # choices worth knowing: uneven splits, attention not run as Ulysses
    memory: MemoryEstimate | None = None  # predicted per rank, from the partitioned graphs
    checkpoint: Checkpoint | None = None

    @property
    def comm_bytes(self) -> float:
        return sum(c.bytes_per_rank for c in self.collectives)

    def count(self, kind: str | None = None, *, backward: bool | None = None) -> int:
        return sum(
            1
            for c in self.collectives
            if (kind is None or c.kind == kind) and (backward is None or c.backward == backward)
        )

    def __str__(self) -> str:
        head = (
            f"autosp plan: sp={self.sp}, {len(self.collectives)} collectives, "
            f"{self.comm_bytes / 2**20:.3f} MiB sent per rank per step"
        )
        rows = [("pass", "collective", "placement", "shape", "MiB/rank", "op", "source")]
        for c in self.collectives:
            rows.append(
                (
                    "bwd" if c.backward else "fwd",
                    c.kind,
                    f"{c.src}->{c.dst}",
                    "x".join(map(str, c.shape)) + f" {c.dtype}",
                    f"{c.bytes_per_rank / 2**20:.4f}",
                    c.op,
                    c.source,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(len(widths))) + "  " + r[-1] for r in rows]
        tail = [str(x) for x in (self.memory, self.checkpoint) if x is not None]
        return "\n".join([head] + lines + [f"note: {x}" for x in self.notes] + tail)


def _backward_nodes(joint: fx.GraphModule) -> set[fx.Node]:
    """The nodes that depend on a tangent: the backward."""
    backward = {nd for nd in joint.graph.nodes if nd.op == "placeholder" and nd.name.startswith("tangents")}
    for nd in joint.graph.nodes:
        if any(a in backward for a in nd.all_input_nodes) and nd.op != "output":
            backward.add(nd)
    return backward


def _dtype(v) -> str:
    return str(v.dtype).replace("torch.", "")


def build_plan(joint: fx.GraphModule, choice: Choice, n: int, notes: tuple[str, ...] = ()) -> Plan:
    """The plan ``explain`` shows for the solved joint graph: every collective on an edge (and one
    row per ring or hybrid attention op, for the exchanges inside its kernel), and the notes."""
    plan = choice.strategy
    backward = _backward_nodes(joint)
    placements = {nd.name: tuple(str(p) for p in s.outs if p is not None) for nd, s in plan.items()}
    colls = []
    out_node = joint.graph.output_node()
    consumers = [(nd, tensor_inputs(nd), plan[nd].ins) for nd in joint.graph.nodes if nd in plan]
    leaves = [a for a in torch.utils._pytree.tree_leaves(out_node.args) if isinstance(a, fx.Node)]
    consumers.append((out_node, [(a, 0) for a in leaves], tuple(R for _ in leaves)))
    moved = set()  # an all-to-all runs once per (value, placement), for every op that reads it so
    for nd, ins, reqs in consumers:
        for (u, i), q in zip(ins, reqs):
            p = plan[u].outs[i]
            kind = redistribute_kind(p, q)
            if not kind or (kind == "all_to_all" and (u, i, q) in moved):
                continue
            if kind == "all_to_all" and nd is not out_node:
                moved.add((u, i, q))
            v = out_vals(u)[i]
            where = nd if nd is not out_node else u
            colls.append(
                Collective(
                    kind,
                    str(p),
                    str(q),
                    tuple(v.shape),
                    _dtype(v),
                    transfer_bytes(kind, nbytes(v), n),
                    u.name,
                    nd.name if nd is not out_node else "output",
                    str(where.target),
                    source_line(where),
                    nd in backward or u in backward,
                )
            )
        if nd is not out_node and plan[nd].kernel in (Kernel.HALO, Kernel.MERGE) and plan[nd].comm:
            v = out_vals(nd)[0]
            p = str(plan[nd].outs[0])
            colls.append(
                Collective(
                    str(plan[nd].kernel),  # boundary rows, or the ranks' reduced results
                    str(plan[nd].ins[0]),
                    p,
                    tuple(v.shape),
                    _dtype(v),
                    plan[nd].comm,
                    ins[0][0].name,
                    nd.name,
                    str(nd.target),
                    source_line(nd),
                    nd in backward,
                )
            )
        if nd is not out_node and plan[nd].kernel in (Kernel.RING, Kernel.HYBRID):  # exchanges inside the kernel
            kv = out_vals(nd.args[2 if is_attention_backward(nd.target) else 1])[0]
            colls.append(
                Collective(
                    str(plan[nd].kernel),
                    "S(2)",
                    "S(2)",
                    tuple(kv.shape),
                    _dtype(kv),
                    plan[nd].comm,
                    nd.args[0].name,
                    nd.name,
                    str(nd.target),
                    source_line(nd),
                    nd in backward,
                )
            )
    notes = (*notes, *attention_notes(joint, plan, n), *fsdp_notes(joint), *_gather_notes(colls))
    return Plan(n, placements, tuple(colls), choice.mem_bytes, notes)


def _gather_notes(colls: list[Collective]) -> list[str]:
    """Why each sharded value is all-gathered: the op that reads it whole, or the step returning it."""

    def why(c: Collective) -> str:
        what = f"{c.producer} ({'x'.join(map(str, c.shape))} {c.dtype}, {c.src}) is all-gathered"
        if c.consumer == "output":
            return (
                f"{what}: the step returns it (made by {c.op} at {c.source}), whole on every rank as "
                "one device returns it; returning a reduction of it (a sum, a mean) keeps it split"
            )
        return (
            f"{what} for {c.op} at {c.source}: no exact strategy of that op keeps it {c.src} (it reads the "
            "sharded dim whole: e.g. x.max(dim), a product or a flip along the sequence, or an op without a "
            "rule on integer data); computing it another way, or autosp.annotate(x, 'R') to make the "
            "gather explicit, is the fix"
        )

    return [why(c) for c in colls if c.kind == "all_gather"]
