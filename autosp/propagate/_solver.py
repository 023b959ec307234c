"""Propagation and the whole-graph choice.

``propagate`` walks the joint graph forward and gives every node its candidate strategies, seeded
from the inputs (parameters may be sliced along any dim; ``autosp.shard``'s inputs only along the
annotated dims). ``solve`` then picks one strategy per node for the whole graph at once, as an
integer program (HiGHS through ``scipy.optimize.milp``): minimise the bytes every rank sends in
the collectives the plan implies (each also costs ``latency_bytes``, so that of two plans moving
the same bytes the one with fewer collectives wins), plus ``mem_weight`` times the bytes each op leaves on a rank
(what makes sharding worth any communication at all).

Bytes are counted as at long context: a tensor with k dims that carry the annotated sequence
(provenance, not sizes) counts ``seq_weight ** k`` times its bytes (k <= 2). The plan is then the
one the same model needs at 32k tokens, where activations dwarf parameters, even when it is made
at a short test length (where all-gathering a 64-token activation would beat all-reducing a
weight gradient).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx
from scipy.optimize import LinearConstraint, milp
from scipy.sparse import coo_array

from ..errors import PlanError, UnsupportedOpError
from ._placement import P, R, can_shard, is_shard, nbytes, redistribute_kind, shard, shard_spec, transfer_bytes
from ._rules import VIEW_OPS, Strategy, hybrid_strategies, out_vals, strategies_for, tensor_inputs

__all__ = ["Candidates", "propagate", "solve", "Choice", "ATTENTION_KERNELS"]


@dataclass(slots=True)
class Candidates:
    """Per node: the strategies it may take, the placements each of its outputs may take
    (``reach``), and the placements along which it carries the annotated sequence (``seq``)."""

    strategies: dict[fx.Node, list[Strategy]] = field(default_factory=dict)
    reach: dict[tuple[fx.Node, int], frozenset] = field(default_factory=dict)
    seq: dict[tuple[fx.Node, int], frozenset] = field(default_factory=dict)
    no_rule: set[fx.Node] = field(default_factory=set)


def _activation(reach: frozenset) -> bool:
    """On the sharded data path: some placement other than Replicate reached it."""
    return any(p != R for p in reach)


def _seq_carrying(node: fx.Node, seq_in: list[frozenset], n: int, mesh) -> list[frozenset]:
    """Provenance: along which (dim, split factor) each output carries the annotated sequence.
    Follows the rules with only sequence shardings as input, plus the attention rules' own
    sequence correspondence (query positions in, query positions out), which no executable
    strategy has."""
    if not any(seq_in):
        return [frozenset() for _ in out_vals(node)]
    strats = strategies_for(node, [sq | {R} for sq in seq_in], n, mesh, provenance=True) or []
    out = []
    for i, v in enumerate(out_vals(node)):
        out.append(frozenset(s.outs[i] for s in strats if v is not None and is_shard(s.outs[i])
                             and any(is_shard(q) and q in seq_in[j] for j, q in enumerate(s.ins))))
    return out


def _justified(s: Strategy, reach) -> bool:
    """A strategy may shard or partial its outputs only because an activation input is sharded
    (or because its rule introduces a sharding, like attention heads): parameters never start a
    sharding, so plans stay sequence-parallel and never drift into tensor parallelism."""
    if s.introduces or all(o is None or o == R for o in s.outs):
        return True
    return any(q != R and _activation(reach[j]) for j, q in enumerate(s.ins))


def propagate(gm: fx.GraphModule, n: int, mesh=None, attention: str = "auto", ulysses: int = 1) -> Candidates:
    """Forward from the annotations, back from what ops ask of their inputs, forward again
    (Shardy's bidirectional propagation, two sweeps): attention asks for heads, and that request
    travels back through the reshapes of grouped-query K/V to where it is cheapest to meet.
    ``attention`` other than "auto" keeps only that kernel's strategies for attention ops;
    ``ulysses`` > 1 (a 2D sp mesh) offers hybrid attention too."""
    first = _forward(gm, n, mesh, {}, attention, ulysses)
    return _forward(gm, n, mesh, _wants(gm, first, n, mesh), attention, ulysses)


ATTENTION_KERNELS = ("auto", "ulysses", "ring", "kv_gather", "hybrid")


def _forced(node: fx.Node, strats: list[Strategy], attention: str) -> list[Strategy]:
    """The strategies of the forced attention kernel (attention ops only, and only while the
    query's sequence reached it: before that, the op runs replicated as it would anyway)."""
    if attention == "auto" or not any(s.kernel for s in strats):
        return strats
    kept = [s for s in strats if s.kernel == attention]
    if not kept:
        have = sorted({s.kernel for s in strats if s.kernel})
        raise PlanError(node, f"attention={attention!r} cannot run this attention op exactly (it can run as {have}); "
                        "ring and kv_gather need self-attention without dropout, ulysses needs head counts that "
                        "split over the ranks, hybrid a 2D sp mesh (autosp.mesh(ulysses=...)) whose sub-groups "
                        "split the head counts, and a length that splits evenly over the ranks",
                        f"use attention='auto' or one of {have}")
    return kept


def _forward(gm: fx.GraphModule, n: int, mesh, wanted: dict, attention: str = "auto", ulysses: int = 1) -> Candidates:
    c = Candidates()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):  # inputs, and constants lifted into the graph
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                c.strategies[node] = [Strategy((R,), ())]
                c.reach[(node, 0)] = frozenset([R])
                c.seq[(node, 0)] = frozenset()
            continue
        if node.op != "call_function":
            continue
        ins = tensor_inputs(node)
        reach = [c.reach[(u, i)] for u, i in ins]
        seq_in = [c.seq[(u, i)] for u, i in ins]
        for i, sq in enumerate(_seq_carrying(node, seq_in, n, mesh)):
            c.seq[(node, i)] = sq
        if node.target is torch.ops.autosp.annotate.default:
            c.seq[(node, 0)] = frozenset(s.outs[0] for s in strategies_for(node, reach, n, mesh) if is_shard(s.outs[0]))
        # an input may be asked for what reached it, any layout that carries the sequence (an
        # all-to-all away: how Ulysses goes back from heads to sequence after attention), or what
        # a later op wants of it
        A = [r | sq | wanted.get(key, frozenset()) for r, sq, key in zip(reach, seq_in, ins)]
        strats = strategies_for(node, A, n, mesh)
        if strats is not None and ulysses > 1:
            strats = strats + hybrid_strategies(node, A, n, ulysses)
        if strats is None:
            c.no_rule.add(node)
            strats = [Strategy(tuple(R if v is not None else None for v in out_vals(node)), tuple(R for _ in ins))]
        strats = _forced(node, [s for s in strats if _justified(s, reach)], attention)
        c.strategies[node] = strats
        for i, v in enumerate(out_vals(node)):
            if v is not None:
                c.reach[(node, i)] = frozenset(s.outs[i] for s in strats)
    return c


def _wants(gm: fx.GraphModule, c: Candidates, n: int, mesh) -> dict:
    """Placements later ops ask of each value that propagation did not reach, carried back
    through the ops that could produce them from another layout of their inputs."""
    wanted: dict[tuple[fx.Node, int], set] = defaultdict(set)
    for node, strats in c.strategies.items():
        for s in strats:
            if s.introduces:
                for key, q in zip(tensor_inputs(node), s.ins):
                    if q not in c.reach[key]:
                        wanted[key].add(q)
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function":
            continue
        ins = tensor_inputs(node)
        for i, v in enumerate(out_vals(node)):
            for p in sorted(wanted.get((node, i), ()), key=str):
                sfs = {1} | ({shard_spec(p)[1]} if is_shard(p) else set())
                A = [frozenset([R, P] + [shard(d, sf) for d in range(out_vals(u)[j].ndim) for sf in sorted(sfs)
                                         if can_shard(out_vals(u)[j].shape[d], sf, n)]) for u, j in ins]
                for s in strategies_for(node, A, n, mesh) or []:
                    if s.outs[i] == p:
                        for key, q in zip(ins, s.ins):
                            if q != R and q not in c.reach[key]:
                                wanted[key].add(q)
    return {k: frozenset(v) for k, v in wanted.items()}


@dataclass(frozen=True, slots=True)
class Choice:
    """The plan: the strategy chosen for every node, and the objective's parts."""

    strategy: dict[fx.Node, Strategy]
    comm_bytes: float
    mem_bytes: float


def _seq_scale(c: Candidates, key: tuple[fx.Node, int], seq_weight: float) -> float:
    """``seq_weight ** k`` for a value with k dims carrying the sequence (provenance), k <= 2."""
    k = len({shard_spec(p)[0] for p in c.seq.get(key, ())})
    return seq_weight ** min(k, 2)


def _out_bytes(c: Candidates, node: fx.Node, s: Strategy, n: int, seq_weight: float) -> float:
    if node.target in VIEW_OPS or node.op != "call_function" or node.target is torch.ops.autosp.annotate.default:
        return 0.0
    total = 0.0
    for i, (v, p) in enumerate(zip(out_vals(node), s.outs)):
        if v is not None and p is not None and c.seq.get((node, i)):  # activations only:
            # parameter-shaped tensors (gradients) end replicated whatever the plan does
            total += nbytes(v) / (n if is_shard(p) else 1) * _seq_scale(c, (node, i), seq_weight)
    return total


_NO_RULE_PENALTY = 1e18


def solve(gm: fx.GraphModule, c: Candidates, n: int, *, mem_weight: float = 4.0,
          seq_weight: float = 64.0, latency_bytes: float = 1e4) -> Choice:
    nodes = [nd for nd in gm.graph.nodes if nd in c.strategies]
    xi: dict[tuple[fx.Node, int], int] = {}
    cost: list[float] = []
    for nd in nodes:
        for k, s in enumerate(c.strategies[nd]):
            xi[(nd, k)] = len(cost)
            # a kernel's own traffic and buffers (ring attention's K/V passes, gathered K/V held for
            # the backward) are K/V-sized: they carry the sequence once
            cost.append(mem_weight * _out_bytes(c, nd, s, n, seq_weight) + (s.comm + mem_weight * s.held) * seq_weight)
    nx = len(cost)
    rows, cols, vals, rhs = [], [], [], []
    nrow = 0

    def add_row(entries, b):
        nonlocal nrow
        for col, v in entries:
            rows.append(nrow); cols.append(col); vals.append(v)
        rhs.append(b)
        nrow += 1

    for nd in nodes:
        if not c.strategies[nd]:
            raise PlanError(nd, "no exact placement for this op with the placements its inputs can take",
                            "annotate its inputs with autosp.annotate to pin a layout")
        add_row([(xi[(nd, k)], 1.0) for k in range(len(c.strategies[nd]))], 1.0)

    consumers = [(nd, c.strategies[nd], tensor_inputs(nd)) for nd in nodes]
    out_node = gm.graph.output_node()
    out_leaves = [a for a in torch.utils._pytree.tree_leaves(out_node.args) if isinstance(a, fx.Node)]
    consumers.append((out_node, [Strategy((), tuple(R for _ in out_leaves))], [(a, 0) for a in out_leaves]))

    edge_info = []
    for v, vstrats, ins in consumers:
        for j, (u, i) in enumerate(ins):
            ustrats = c.strategies[u]
            P_u = sorted({s.outs[i] for s in ustrats}, key=str)
            Q_v = sorted({s.ins[j] for s in vstrats}, key=str)
            size = nbytes(out_vals(u)[i]) * _seq_scale(c, (u, i), seq_weight)
            ys = {}
            for p in P_u:
                for q in Q_v:
                    kind = redistribute_kind(p, q)
                    if kind is None:
                        continue
                    ys[(p, q)] = len(cost)
                    # partial outputs (gradients) are all-reduced together in buckets at the end
                    # (partition._localize): no per-collective latency there
                    latency = latency_bytes if kind and not (v is out_node and kind == "all_reduce") else 0.0
                    # an op without a rule runs replicated. Index and mask bookkeeping (integer
                    # or bool data, e.g. HF's padding_mask[batch_idx, kv_idx]) is then computed
                    # replicated from the full inputs, for free; a collective into one on
                    # floating-point data is an error below (an all-gather of activations should
                    # be the user's explicit choice: autosp.annotate(x, "R"))
                    # (float data: a tie-breaker, so that an equally cheap gather one op earlier,
                    # where a rule exists, wins over one straight into the rule-less op)
                    forbidden = 0.0
                    if kind and v in c.no_rule:
                        forbidden = 2 * latency_bytes if out_vals(u)[i].dtype.is_floating_point else _NO_RULE_PENALTY
                    cost.append(transfer_bytes(kind, size, n) + latency + forbidden)
                    edge_info.append((v, j, u, p, q, kind))
            for p in P_u:
                add_row([(ys[(p, q)], 1.0) for q in Q_v if (p, q) in ys]
                        + [(xi[(u, k)], -1.0) for k, s in enumerate(ustrats) if s.outs[i] == p], 0.0)
            for q in Q_v:
                fixed = v is out_node
                add_row([(ys[(p, q)], 1.0) for p in P_u if (p, q) in ys]
                        + ([] if fixed else [(xi[(v, k)], -1.0) for k, s in enumerate(vstrats) if s.ins[j] == q]),
                        1.0 if fixed else 0.0)

    A = coo_array((vals, (rows, cols)), shape=(nrow, len(cost))).tocsr()
    integrality = np.zeros(len(cost)); integrality[:nx] = 1
    res = milp(np.array(cost), integrality=integrality, bounds=(0, 1),
               constraints=LinearConstraint(A, np.array(rhs), np.array(rhs)))
    if res.x is None:
        raise PlanError(None, f"no consistent sharding plan exists for this graph ({res.message})",
                        "check the autosp.annotate constraints for conflicts")
    x = res.x
    chosen = {}
    for nd in nodes:
        k = max(range(len(c.strategies[nd])), key=lambda k: x[xi[(nd, k)]])
        chosen[nd] = c.strategies[nd][k]
    comm = sum(cost[i] * x[i] for i in range(nx, len(cost)))  # as the solver saw it: scaled
    mem = sum(_out_bytes(c, nd, chosen[nd], n, 1.0) for nd in nodes)
    for nd in c.no_rule:
        for (u, i), q in zip(tensor_inputs(nd), chosen[nd].ins):
            src = chosen[u].outs[i]
            if redistribute_kind(src, q):
                raise UnsupportedOpError(nd, f"no sharding rule for {nd.target}, and its input {u.name} is {src} here",
                                         "express the computation with supported ops, or pin its inputs replicated "
                                         "with autosp.annotate(x, 'R') before it (costs an all-gather)")
    return Choice(chosen, comm, mem)
