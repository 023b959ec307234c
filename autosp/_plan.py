"""The plan ``autosp.explain`` returns: every node's placement and every inserted collective."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .errors import source_line
from .partition._checkpoint import Checkpoint
from .partition._fsdp import GATHER
from .partition._memory import MemoryEstimate
from .propagate._placement import R, chunks, nbytes, redistribute_kind, transfer_bytes
from .propagate._rules import _heads_split, _is_causal as _causal, out_vals, tensor_inputs
from .propagate._solver import Choice

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
        return sum(1 for c in self.collectives
                   if (kind is None or c.kind == kind) and (backward is None or c.backward == backward))

    def __str__(self) -> str:
        head = f"autosp plan: sp={self.sp}, {len(self.collectives)} collectives, " \
               f"{self.comm_bytes / 2**20:.3f} MiB sent per rank per step"
        rows = [("pass", "collective", "placement", "shape", "MiB/rank", "op", "source")]
        for c in self.collectives:
            rows.append(("bwd" if c.backward else "fwd", c.kind, f"{c.src}->{c.dst}", "x".join(map(str, c.shape)) + f" {c.dtype}",
                         f"{c.bytes_per_rank / 2**20:.4f}", c.op, c.source))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(len(widths))) + "  " + r[-1] for r in rows]
        tail = [str(x) for x in (self.memory, self.checkpoint) if x is not None]
        return "\n".join([head] + lines + [f"note: {x}" for x in self.notes] + tail)


def build_plan(joint: fx.GraphModule, choice: Choice, n: int) -> Plan:
    plan = choice.strategy
    tangents = {nd for nd in joint.graph.nodes if nd.op == "placeholder" and nd.name.startswith("tangents")}
    backward: set[fx.Node] = set(tangents)
    for nd in joint.graph.nodes:
        if any(a in backward for a in nd.all_input_nodes) and nd.op != "output":
            backward.add(nd)
    placements = {nd.name: tuple(str(p) for p in s.outs if p is not None) for nd, s in plan.items()}
    colls = []
    out_node = joint.graph.output_node()
    consumers = [(nd, tensor_inputs(nd), plan[nd].ins) for nd in joint.graph.nodes if nd in plan]
    leaves = [a for a in torch.utils._pytree.tree_leaves(out_node.args) if isinstance(a, fx.Node)]
    consumers.append((out_node, [(a, 0) for a in leaves], tuple(R for _ in leaves)))
    for nd, ins, reqs in consumers:
        for (u, i), q in zip(ins, reqs):
            p = plan[u].outs[i]
            kind = redistribute_kind(p, q)
            if not kind:
                continue
            v = out_vals(u)[i]
            where = nd if nd is not out_node else u
            colls.append(Collective(kind, str(p), str(q), tuple(v.shape), str(v.dtype).replace("torch.", ""),
                                    transfer_bytes(kind, nbytes(v), n), u.name,
                                    nd.name if nd is not out_node else "output",
                                    str(where.target), source_line(where), nd in backward or u in backward))
        if nd is not out_node and plan[nd].kernel in ("ring", "hybrid"):  # exchanges inside the kernel: one row
            kv = out_vals(nd.args[2 if "backward" in str(nd.target) else 1])[0]
            colls.append(Collective(plan[nd].kernel, "S(2)", "S(2)", tuple(kv.shape), str(kv.dtype).replace("torch.", ""),
                                    plan[nd].comm, nd.args[0].name, nd.name, str(nd.target), source_line(nd),
                                    nd in backward))
    return Plan(n, placements, tuple(colls), choice.mem_bytes, tuple(_attention_notes(joint, plan, n) + _fsdp_notes(joint)))


def _fsdp_notes(joint: fx.GraphModule) -> list[str]:
    """One line for FSDP2's parameters: how many, over how many ranks, and when they are gathered."""
    gathers = [nd for nd in joint.graph.nodes if nd.op == "call_function" and nd.target is GATHER]
    if not gathers:
        return []
    full = sum(nbytes(out_vals(nd)[0]) for nd in gathers)
    worlds = sorted({nd.args[3] for nd in gathers})
    again = sum(bool(nd.args[6]) for nd in gathers)
    return [f"FSDP2: {len(gathers)} parameters ({full / 2**20:.1f} MiB in full) sharded over {worlds} ranks: each "
            f"gathered before its first use in the forward, {again} of them again in the backward (their modules "
            "reshard after forward), gradients reduce-scattered"]


def _attention_notes(joint: fx.GraphModule, plan, n: int) -> list[str]:
    """Say how each attention op runs when it is not plain Ulysses (heads split evenly)."""
    notes = []
    for nd in joint.graph.nodes:
        if nd.op != "call_function" or "scaled_dot_product" not in str(nd.target) or "backward" in str(nd.target):
            continue
        q, k = out_vals(nd.args[0])[0], out_vals(nd.args[1])[0]
        H, KV = q.shape[1], k.shape[1]
        kernel = plan[nd].kernel
        where = f"attention at {source_line(nd)}"
        heads = f"{H} query / {KV} K/V heads" + ("" if _heads_split(q, k, n) else f" do not split over sp={n}")
        if kernel == "ulysses":
            if H % n:
                notes.append(f"{where}: {H} heads split unevenly over sp={n} (heads per rank {chunks(H, n)}); "
                             "the ranks with more heads set the pace of attention")
        elif kernel == "batch":
            notes.append(f"{where}: split over the batch ({q.shape[0]} sequences) instead of the heads")
        elif kernel == "kv_gather":
            notes.append(f"{where}: {heads}: the query stays sequence-sharded and K/V are all-gathered (their "
                         "gradients reduce-scattered)")
        elif kernel == "ring":
            notes.append(f"{where}: {heads}: ring attention, the query stays sequence-sharded and K/V chunks pass "
                         f"around the ranks ({plan[nd].comm / 2**20:.3f} MiB sent per rank in the forward)"
                         + (", causal work balanced by a zigzag of query half-chunks" if _causal(nd) else ""))
        elif kernel == "hybrid":
            notes.append(f"{where}: {heads}: hybrid attention, all-to-alls within sp sub-groups and a ring across "
                         f"them ({plan[nd].comm / 2**20:.3f} MiB sent per rank in the forward)")
        else:
            why = f"{H} query heads < sp={n}" if H < n else f"{H} query / {KV} K/V heads do not split over sp={n}"
            notes.append(f"{where}: not Ulysses ({why}); it runs on inputs placed {plan[nd].ins[0]} (Q), "
                         f"{plan[nd].ins[1]} (K), {plan[nd].ins[2]} (V): see the all-gathers above")
    return notes
