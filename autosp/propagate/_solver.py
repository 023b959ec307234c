"""The whole-graph choice: one strategy per node, picked for the whole graph at once.

``solve`` states the choice as an integer program (HiGHS through ``scipy.optimize.milp``) and
minimises the bytes every rank sends in the collectives the plan implies (each also costs
``latency_bytes``, so that of two plans moving the same bytes the one with fewer collectives
wins), plus ``mem_weight`` times the bytes each op leaves on a rank (what makes sharding worth any
communication at all).

Bytes are counted as at long context: a tensor with k dims that carry the annotated sequence
(provenance, not sizes) counts ``seq_weight ** k`` times its bytes (k <= 2). The plan is then the
one the same model needs at 32k tokens, where activations dwarf parameters, even when it is made
at a short test length (where all-gathering a 64-token activation would beat all-reducing a
weight gradient).

The program. A binary variable per (node, strategy): the node takes that strategy, exactly one per
node. Per edge (a consumer's input j, produced as output i of u) a continuous variable per
(placement p that u may produce, placement q that the consumer may require) with a collective
from p to q: the edge's flow. Its flow out of p equals u's choice of a strategy producing p; its
flow into q equals the consumer's choice of a strategy requiring q (the graph's outputs require
Replicate). Each flow costs its collective's bytes; an all-to-all's bytes are on one variable per
(value, p, q), at least every flow of it, since it runs once for all the ops that read it.

A repeated block's alike calls choose alike (``_alike``): a node of a later call takes the
variables of its counterpart in the first call, its costs added to theirs, and an edge whose two
ends choose as an earlier edge's do takes that edge's flows (in every solution they carry what
that edge's carry), its costs added to theirs. The program grows with the distinct blocks, not
with the depth; its optimum is the one the program with every node and edge apart has.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx
from scipy.optimize import LinearConstraint, milp
from scipy.sparse import coo_array

from .._attention_ops import padded_lse
from .._context import Kernel, SpContext
from .._graph import nbytes, out_vals, tensor_inputs
from .._repeats import calls
from ..errors import PlanError, UnsupportedOpError, module_path
from ._annotate import ANNOTATE
from ._dtensor import DISPATCH_OPS
from ._placement import R, is_shard, redistribute_kind, shard_spec, transfer_bytes
from ._propagate import Candidates, Key
from ._rules import VIEW_OPS
from ._strategy import Strategy

__all__ = ["Choice", "solve"]

SEQ_WEIGHT = 64.0  # how much more a byte along the sequence weighs (see the module docstring)
LATENCY_BYTES = 1e4  # what one collective costs beyond its bytes
TIE_BYTES = 1e-3  # a strategy's tie-break cost per place in its node's list (``_tie_break``)
_NO_RULE_PENALTY = 1e18  # a collective into an op without a rule, on integer or bool data


@dataclass(frozen=True, slots=True)
class Choice:
    """The plan: the strategy chosen for every node, and the objective's parts."""

    strategy: dict[fx.Node, Strategy]
    comm_bytes: float
    mem_bytes: float


def _seq_scale(c: Candidates, key: Key) -> float:
    """``SEQ_WEIGHT ** k`` for a value with k dims carrying the sequence (provenance; an attention
    mask's rows and columns both), k <= 2."""
    k = 2 if key in c.rows else len({shard_spec(p)[0] for p in c.seq.get(key, ())})
    return SEQ_WEIGHT ** min(k, 2)


def _out_bytes(c: Candidates, node: fx.Node, s: Strategy, n: int, scaled: bool = True) -> float:
    """The activation bytes a node leaves on a rank under strategy ``s`` (views and annotations
    leave none of their own)."""
    if node.target in VIEW_OPS or node.op != "call_function" or node.target is ANNOTATE:
        return 0.0
    total = 0.0
    for i, (v, p) in enumerate(zip(out_vals(node), s.outs)):
        if v is not None and p is not None and c.seq.get((node, i)):  # activations only:
            # parameter-shaped tensors (gradients) end replicated whatever the plan does
            total += nbytes(v) / (n if is_shard(p) else 1) * (_seq_scale(c, (node, i)) if scaled else 1.0)
    return total


class _Program:
    """A 0/1 linear program being written: variables with their costs, and equality rows."""

    def __init__(self):
        self.cost: list[float] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.rhs: list[float] = []

    def var(self, cost: float) -> int:
        self.cost.append(cost)
        return len(self.cost) - 1

    def equal(self, entries, rhs: float) -> None:
        """sum(coefficient * variable for variable, coefficient in entries) == rhs"""
        row = len(self.rhs)
        for col, v in entries:
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(v)
        self.rhs.append(rhs)

    def minimise(self, integer: int) -> np.ndarray | None:
        """The optimum, the first ``integer`` variables binary and the rest in [0, 1]."""
        A = coo_array((self.vals, (self.rows, self.cols)), shape=(len(self.rhs), len(self.cost))).tocsr()
        integrality = np.zeros(len(self.cost))
        integrality[:integer] = 1
        rhs = np.array(self.rhs)
        # proven optimal (HiGHS stops within 1e-4 of it by default): the tie-break below decides
        res = milp(
            np.array(self.cost),
            integrality=integrality,
            bounds=(0, 1),
            constraints=LinearConstraint(A, rhs, rhs),
            options={"mip_rel_gap": 0.0},
        )
        if res.x is None:
            raise PlanError(
                None,
                f"no consistent sharding plan exists for this graph ({res.message})",
                "check the autosp.annotate constraints for conflicts",
            )
        return res.x


def _edges(gm: fx.GraphModule, c: Candidates, nodes: list[fx.Node]):
    """(consumer, its strategies, its tensor inputs) for every node and for the graph's output,
    which requires every returned value replicated."""
    out = [(nd, c.strategies[nd], tensor_inputs(nd)) for nd in nodes]
    out_node = gm.graph.output_node()
    leaves = [a for a in torch.utils._pytree.tree_leaves(out_node.args) if isinstance(a, fx.Node)]
    out.append((out_node, [Strategy((), tuple(R for _ in leaves))], [(a, 0) for a in leaves]))
    return out


def _flow_cost(c: Candidates, v: fx.Node, u: fx.Node, i: int, kind: str, size: float, n: int, is_output: bool) -> float:
    """What one edge's collective ``kind`` costs."""
    # partial outputs (gradients) are all-reduced together in buckets at the end
    # (partition._outputs): no per-collective latency there
    latency = LATENCY_BYTES if kind and not (is_output and kind == "all_reduce") else 0.0
    # an op without a rule runs replicated. Index and mask bookkeeping (integer or bool data,
    # e.g. HF's padding_mask[batch_idx, kv_idx]) is then computed replicated from the full
    # inputs, for free; a collective into one on floating-point data is an error (``_check_no_rule``:
    # an all-gather of activations should be the user's explicit choice, autosp.annotate(x, "R")).
    # On float data the penalty is a tie-breaker, so that an equally cheap gather one op earlier,
    # where a rule exists, wins over one straight into the rule-less op.
    forbidden = 0.0
    if kind and v in c.no_rule:
        forbidden = 2 * LATENCY_BYTES if out_vals(u)[i].dtype.is_floating_point else _NO_RULE_PENALTY
    if kind and (u, i) in c.rows:
        # a mask is built from replicated inputs: any layout of it is free, a collective never is
        # (its memory is counted where it is built, not where a gather would land it whole)
        forbidden = _NO_RULE_PENALTY
    return transfer_bytes(kind, size, n) + latency + forbidden


def _add_edge(
    prog: _Program, c: Candidates, choose: dict, edge, j: int, n: int, is_output: bool, shared: dict, built: dict
) -> None:
    """Flow variables and their two sets of rows for input j of a consumer (see the module
    docstring). An all-to-all runs once per (value, placement), however many ops read it
    (``partition._localize`` reuses it): its cost is on one variable per (value, source,
    destination) in ``shared``, at least each of its edges' flows. ``built``: the flows of each
    edge by its ends' variables; an edge whose ends choose as a built one's takes its flows."""
    v, v_strategies, ins = edge
    u, i = ins[j]
    produced = sorted({s.outs[i] for s in c.strategies[u]}, key=str)
    required = sorted({s.ins[j] for s in v_strategies}, key=str)
    size = nbytes(out_vals(u)[i]) * _seq_scale(c, (u, i))
    fixed = padded_lse(u, i) is not None  # the attention backward reading it runs split as its forward
    ends = (id(choose[u]), i, id(choose[v]) if v in choose else v, j)
    flow = built.get(ends)
    taken = flow is not None

    def var(pq, cost: float) -> int:
        if taken:  # an alike edge's flow: the same value in every solution, the costs add
            prog.cost[flow[pq]] += cost
        else:
            flow[pq] = prog.var(cost)
        return flow[pq]

    flow = flow if taken else {}
    for p in produced:
        for q in required:
            kind = redistribute_kind(p, q)
            if kind is None or (fixed and p != q):
                continue
            cost = _flow_cost(c, v, u, i, kind, size, n, is_output)
            if kind != "all_to_all" or is_output:
                var((p, q), cost)
                continue
            once = _flow_cost(c, None, u, i, kind, size, n, is_output)  # the collective itself
            key = (u, i, p, q)
            if key not in shared:
                shared[key] = prog.var(once)
            mine = var((p, q), cost - once)  # this consumer's own part (a no-rule penalty)
            prog.equal([(shared[key], 1.0), (mine, -1.0), (prog.var(0.0), -1.0)], 0.0)  # slack >= 0
    if taken:  # its rows are the built edge's
        return
    built[ends] = flow
    for p in produced:
        prog.equal(
            [(flow[(p, q)], 1.0) for q in required if (p, q) in flow]
            + [(choose[u][k], -1.0) for k, s in enumerate(c.strategies[u]) if s.outs[i] == p],
            0.0,
        )
    for q in required:
        taken = [] if is_output else [(choose[v][k], -1.0) for k, s in enumerate(v_strategies) if s.ins[j] == q]
        prog.equal([(flow[(p, q)], 1.0) for p in produced if (p, q) in flow] + taken, 1.0 if is_output else 0.0)


def _check_no_rule(c: Candidates, chosen: dict[fx.Node, Strategy]) -> None:
    """An op without a rule may read only what needs no collective to reach it replicated."""
    for nd in c.no_rule:
        for (u, i), q in zip(tensor_inputs(nd), chosen[nd].ins):
            src = chosen[u].outs[i]
            if redistribute_kind(src, q):
                custom = getattr(nd.target, "namespace", "aten") not in ("aten", "prims")
                modules = module_path(nd)
                # a dispatch op, or a custom op inside a module (torchtitan's scatter-add in its MoE)
                local = nd.target in DISPATCH_OPS or (custom and modules)
                raise UnsupportedOpError(
                    nd,
                    f"no sharding rule for {nd.target}, and its input {u.name} is {src} here"
                    + (f", inside {modules}" if modules else ""),
                    (
                        "if a module around it maps each token to its own output (a mixture-of-experts layer "
                        "dispatching tokens with no capacity limit), mark it: autosp.token_local(module); else "
                        if local
                        else ""
                    )
                    + (
                        "give the op a rule with torch.distributed.tensor.experimental.register_sharding "
                        "(autosp takes the placements it runs exactly), "
                        if custom
                        else ""
                    )
                    + "express the computation with supported ops, or pin its inputs replicated "
                    "with autosp.annotate(x, 'R') before it (costs an all-gather)",
                )


def _kernel_cost(s: Strategy, mem_weight: float) -> float:
    """A kernel's own traffic and buffers. Attention's (ring attention's K/V passes, gathered K/V
    held for the backward) are K/V-sized: they carry the sequence once. A halo exchange's are
    boundary rows, and a merge's the reduced results, whatever the length: and one collective."""
    if s.kernel in (Kernel.HALO, Kernel.MERGE):
        return s.comm + (LATENCY_BYTES if s.comm else 0.0)
    return (s.comm + mem_weight * s.held) * SEQ_WEIGHT


def _alike(blocks: list, c: Candidates) -> list[tuple[fx.Node, fx.Node]]:
    """Pairs of nodes that take the same strategy: each node of a repeated block's call and its
    counterpart in the first call of the same ops on the same shapes (``_repeats``), where every
    node of the two has the same candidates. A repeated block is then planned once, whatever
    its depth: the same collectives in every layer (not an equally cheap mix the solver happens
    to pick, which the per-rank graph would have to trace call by call, ``partition._stamp``)."""
    first: dict[tuple, list[fx.Node]] = {}
    pairs = []
    for call in blocks:
        nodes = [nd for nd in call.nodes if nd in c.strategies]
        ref = first.setdefault((call.name, call.signature), nodes)
        if ref is not nodes and all(c.strategies[a] == c.strategies[b] for a, b in zip(nodes, ref, strict=True)):
            pairs += zip(nodes, ref, strict=True)
    return pairs


def _tie_order(strategies: list[Strategy]) -> list[int]:
    """Each strategy's place in the order ties are broken in: those leaving fewer outputs whole
    (replicated) first, then as listed. Of two plans that send and keep the same bytes, the one
    that keeps a value split further takes it: a value the step returns is gathered where it is
    returned, not one op before (a view of it: the same bytes, but the plan's note then named the
    view as reading the sequence whole)."""
    ranked = sorted(range(len(strategies)), key=lambda k: (sum(o == R for o in strategies[k].outs), k))
    place = [0] * len(strategies)
    for at, k in enumerate(ranked):
        place[k] = at
    return place


def _tie_break(blocks: list, nodes: list[fx.Node]) -> dict[fx.Node, float]:
    """Each node's tie-break weight: its k-th strategy (``_tie_order``) costs k times it more. Plans of the same
    cost are common (a rotary embedding on q before the all-to-all and on k after it, or the
    other way round), and the solver took any, so the same model captured otherwise (its blocks
    traced each, not once) was planned otherwise, with another checkpointing ladder. The weight
    is ``TIE_BYTES`` times 1 to 2, from the node's op and its place among the ops of the same
    target in its repeated block's call (or outside the calls): what does not change with how the
    graph was captured. At most a few bytes over a whole graph: below any difference in what a
    plan moves or keeps."""
    where: dict[fx.Node, tuple] = {}
    for call in blocks:
        seen: dict[str, int] = {}
        for nd in call.nodes:
            t = str(nd.target)
            seen[t] = seen.get(t, 0) + 1
            where[nd] = (t, seen[t])
    seen = {}
    weight = {}
    for nd in nodes:
        if nd not in where:
            t = str(nd.target)
            seen[t] = seen.get(t, 0) + 1
            where[nd] = ("outside", t, seen[t])
        weight[nd] = TIE_BYTES * (1 + zlib.crc32(repr(where[nd]).encode()) % 997 / 997)
    return weight


def solve(gm: fx.GraphModule, c: Candidates, ctx: SpContext) -> Choice:
    """One strategy per node of ``gm`` from its candidates ``c``, for the least cost of the whole
    graph (see the module docstring); raises ``PlanError`` where no exact plan exists."""
    # an sp group of one rank weighs placements as two ranks would: with one, every placement
    # costs nothing and ties would pick any, where the tiling and the checkpointing pass read the
    # sequence-sharded ones (its collectives are removed afterwards: ``drop_lone_collectives``)
    n, mem_weight = max(ctx.n, 2), ctx.options.mem_weight
    nodes = [nd for nd in gm.graph.nodes if nd in c.strategies]
    prog = _Program()
    choose: dict[fx.Node, list[int]] = {}  # node -> its strategies' variables
    blocks = calls(gm.graph)
    tie = _tie_break(blocks, nodes)
    alike = dict(_alike(blocks, c))  # a later call's node -> its counterpart in the first call
    for nd in nodes:
        order = _tie_order(c.strategies[nd])
        costs = [
            mem_weight * _out_bytes(c, nd, s, n) + _kernel_cost(s, mem_weight) + tie[nd] * order[k]
            for k, s in enumerate(c.strategies[nd])
        ]
        if nd in alike:  # alike calls choose alike: one set of variables, the costs added
            choose[nd] = choose[alike[nd]]
            for x, cost in zip(choose[nd], costs, strict=True):
                prog.cost[x] += cost
        else:
            choose[nd] = [prog.var(cost) for cost in costs]
    for nd in nodes:
        if not c.strategies[nd]:
            raise PlanError(
                nd,
                "no exact placement for this op with the placements its inputs can take",
                "annotate its inputs with autosp.annotate to pin a layout",
            )
        if nd not in alike:
            prog.equal([(x, 1.0) for x in choose[nd]], 1.0)
    n_choices = len(prog.cost)
    out_node = gm.graph.output_node()
    shared: dict = {}
    built: dict = {}
    for edge in _edges(gm, c, nodes):
        for j in range(len(edge[2])):
            _add_edge(prog, c, choose, edge, j, n, edge[0] is out_node, shared, built)
    x = prog.minimise(n_choices)
    chosen = {nd: c.strategies[nd][max(range(len(choose[nd])), key=lambda k: x[choose[nd][k]])] for nd in nodes}
    comm = sum(prog.cost[k] * x[k] for k in range(n_choices, len(prog.cost)))  # as the solver saw it: scaled
    mem = sum(_out_bytes(c, nd, chosen[nd], n, scaled=False) for nd in nodes)
    _check_no_rule(c, chosen)
    return Choice(chosen, comm, mem)
