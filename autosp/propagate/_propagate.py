"""Propagation: every node's candidate strategies, seeded from the annotations.

Forward from the annotations, back from what ops ask of their inputs, forward again (Shardy's
bidirectional propagation, two sweeps): attention asks for heads, and that request travels back
through the reshapes of grouped-query K/V to where it is cheapest to meet. Parameters never start
a sharding (``_justified``): plans stay sequence-parallel and never drift into tensor parallelism.
Alongside, ``seq`` tracks along which placements each value carries the annotated sequence
(provenance, not sizes): the solver weighs those bytes as at long context.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .._context import ATTENTION_KERNELS, SpContext
from .._graph import out_vals, tensor_inputs
from .._repeats import Call, calls
from ..errors import PlanError
from ._annotate import ANNOTATE
from ._attention import hybrid_strategies
from ._flex import FLEX, FLEX_BACKWARD
from ._placement import P, R, can_shard, is_shard, shard, shard_spec
from ._rules import FILLED_FACTORIES, selection_read, strategies_for
from ._strategy import Strategy

__all__ = ["Candidates", "propagate"]

Key = tuple[fx.Node, int]  # a value: (producer, output index)


@dataclass(slots=True)
class Candidates:
    """Per node: the strategies it may take, the placements each of its outputs may take
    (``reach``), and the placements along which it carries the annotated sequence (``seq``);
    ``no_rule``: the nodes no rule knows (they run replicated); ``rows``: values built from
    replicated inputs that attention may read split (a mask: its rows and columns both the
    sequence, so its size grows with the square of the length)."""

    strategies: dict[fx.Node, list[Strategy]] = field(default_factory=dict)
    reach: dict[Key, frozenset] = field(default_factory=dict)
    seq: dict[Key, frozenset] = field(default_factory=dict)
    no_rule: set[fx.Node] = field(default_factory=set)
    rows: set[Key] = field(default_factory=set)


def propagate(gm: fx.GraphModule, ctx: SpContext) -> Candidates:
    """Candidate strategies for every node of the joint graph (see the module docstring).
    ``ctx.options.attention`` other than "auto" keeps only that kernel's strategies for attention
    ops; a 2D sp mesh (``ctx.ulysses`` > 1) offers hybrid attention too."""
    blocks = calls(gm.graph)
    first = _forward(gm, ctx, {}, blocks=blocks)
    wanted, rows = _wants(gm, first, ctx)
    return _forward(gm, ctx, wanted, rows, blocks)


def _activation(reach: frozenset) -> bool:
    """On the sharded data path: some placement other than Replicate reached it."""
    return any(p != R for p in reach)


def _seq_carrying(node: fx.Node, seq_in: list[frozenset], ctx: SpContext) -> list[frozenset]:
    """Provenance: along which (dim, split factor) each output carries the annotated sequence.
    Follows the rules with only sequence shardings as input, plus the attention rules' own
    sequence correspondence (query positions in, query positions out), which no executable
    strategy has."""
    if not any(seq_in):
        return [frozenset() for _ in out_vals(node)]
    strats = strategies_for(node, [sq | {R} for sq in seq_in], ctx.n, ctx.mesh, provenance=True) or []
    out = []
    for i, v in enumerate(out_vals(node)):
        out.append(
            frozenset(
                s.outs[i]
                for s in strats
                if v is not None
                and is_shard(s.outs[i])
                and any(is_shard(q) and q in seq_in[j] for j, q in enumerate(s.ins))
            )
        )
    return out


def _justified(s: Strategy, reach) -> bool:
    """A strategy may shard or partial its outputs only because an activation input is sharded
    (or because its rule introduces a sharding, like attention heads): parameters never start a
    sharding, so plans stay sequence-parallel and never drift into tensor parallelism."""
    if s.introduces or all(o is None or o == R for o in s.outs):
        return True
    return any(q != R and _activation(reach[j]) for j, q in enumerate(s.ins))


def _forced(node: fx.Node, strats: list[Strategy], attention: str, n: int) -> list[Strategy]:
    """The strategies of the forced attention kernel (attention ops only, and only while the
    query's sequence reached it: before that, the op runs replicated as it would anyway). On an sp
    group of one rank every kernel is attention run whole: none is forced."""
    if attention == "auto" or n == 1 or not any(s.kernel in ATTENTION_KERNELS for s in strats):
        return strats
    kept = [s for s in strats if s.kernel == attention]
    if not kept:
        have = sorted({str(s.kernel) for s in strats if s.kernel})
        raise PlanError(
            node,
            f"attention={attention!r} cannot run this attention op exactly (it can run as {have}); "
            "ring and kv_gather need self-attention without dropout, ulysses needs head counts that "
            "split over the ranks, hybrid a 2D sp mesh (autosp.mesh(ulysses=...)) whose sub-groups "
            "split the head counts, and a length that splits evenly over the ranks",
            f"use attention='auto' or one of {have}",
        )
    return kept


def _seed(c: Candidates, node: fx.Node) -> None:
    """Inputs, and constants lifted into the graph: replicated, carrying no sequence."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        c.strategies[node] = [Strategy((R,), ())]
        c.reach[(node, 0)] = frozenset([R])
        c.seq[(node, 0)] = frozenset()


def _forward(
    gm: fx.GraphModule, ctx: SpContext, wanted: dict, rows: dict | None = None, blocks: list[Call] = ()
) -> Candidates:
    """One sweep. A repeated block's call (``blocks``) whose context is an earlier alike call's
    (``_context``) takes that call's candidates node for node, not visited again: propagating
    costs one visit per distinct block and context, not one per layer."""
    rows = rows or {}
    c = Candidates(rows={k for k, v in rows.items() if v})
    starts = {call.nodes[0]: call for call in blocks}
    seen: dict[tuple, Call] = {}
    copied: set[fx.Node] = set()
    for node in gm.graph.nodes:
        call = starts.get(node)
        if call is not None and (key := _context(c, call, wanted, rows)) is not None:
            ref = seen.setdefault(key, call)
            if ref is not call:
                _take(c, ref, call)
                copied.update(call.nodes)
        if node in copied:
            continue
        if node.op in ("placeholder", "get_attr"):
            _seed(c, node)
        elif node.op == "call_function":
            _visit(c, node, ctx, wanted, rows)
    return c


# ops whose rules read the graph beyond their own arguments (FlexAttention's: whether a backward
# returns a gradient for a captured tensor): a call holding one is always visited
_READS_GRAPH = (FLEX, FLEX_BACKWARD)


def _context(c: Candidates, call: Call, wanted: dict, rows: dict) -> tuple | None:
    """What ``_visit`` reads for ``call``'s nodes besides their ops and shapes (``Call.signature``):
    the reach, sequence and requests of each value it reads from outside, in order, and the
    requests and mask rows of its own values, by position; None where a rule reads more (a call
    that is then visited node by node)."""
    at = {nd: i for i, nd in enumerate(call.nodes)}
    outside, own = [], []
    for nd in call.nodes:
        if nd.target in _READS_GRAPH:
            return None
        for key in tensor_inputs(nd):
            if key[0] not in at:
                outside.append((c.reach.get(key), c.seq.get(key), wanted.get(key)))
        read = selection_read(nd) if nd.op == "call_function" else None
        if read is not None:  # the selection it scatters into: by position inside, else itself
            read = (at[read[0]], read[1]) if read[0] in at else (read, c.seq.get(read))
        own.append((read, *((wanted.get((nd, i)), rows.get((nd, i))) for i in range(len(out_vals(nd))))))
    return (call.name, call.signature, tuple(outside), tuple(own))


def _take(c: Candidates, ref: Call, call: Call) -> None:
    """``ref``'s candidates for ``call``'s nodes, node for node (strategies are placements only)."""
    for a, b in zip(ref.nodes, call.nodes, strict=True):
        if a in c.strategies:
            c.strategies[b] = c.strategies[a]
        if a in c.no_rule:
            c.no_rule.add(b)
        for i in range(len(out_vals(a))):
            for table in (c.reach, c.seq):
                if (a, i) in table:
                    table[(b, i)] = table[(a, i)]


def _rows_justified(node: fx.Node, s: Strategy, rows: dict) -> bool:
    """A value built from replicated inputs alone (an attention mask, from positions), laid out
    by the query rows that sequence-sharded attention asks of it: computed that way from its
    inputs' slices, it is never whole on a rank."""
    return all(o is None or o == R or o in rows.get((node, i), ()) for i, o in enumerate(s.outs))


def _visit(c: Candidates, node: fx.Node, ctx: SpContext, wanted: dict, rows: dict) -> None:
    """One node of the forward sweep: its sequence provenance, strategies and reach."""
    n = ctx.n
    ins = tensor_inputs(node)
    reach = [c.reach[(u, i)] for u, i in ins]
    seq_in = [c.seq[(u, i)] for u, i in ins]
    for i, sq in enumerate(_seq_carrying(node, seq_in, ctx)):
        # a mask's query rows carry the sequence though it is built from positions: the solver
        # weighs its bytes as an activation's
        c.seq[(node, i)] = sq | rows.get((node, i), frozenset())
    read = selection_read(node)
    if read is not None:  # a selection's gradient goes back into the rows it read, as they carried it
        c.seq[(node, 0)] = c.seq[(node, 0)] | c.seq[read]
    if node.target is ANNOTATE:  # where the annotated sequence starts
        c.seq[(node, 0)] = frozenset(s.outs[0] for s in strategies_for(node, reach, n, ctx.mesh) if is_shard(s.outs[0]))
    # an input may be asked for what reached it, any layout that carries the sequence (an
    # all-to-all away: how Ulysses goes back from heads to sequence after attention), or what
    # a later op wants of it
    A = [r | sq | wanted.get(key, frozenset()) for r, sq, key in zip(reach, seq_in, ins)]
    if read is not None:  # its zeros may be laid out as those rows
        A[0] = A[0] | c.seq[read]
    strats = strategies_for(node, A, n, ctx.mesh)
    if strats is not None and ctx.ulysses > 1:
        strats = strats + hybrid_strategies(node, A, n, ctx.ulysses)
    if strats is None:
        c.no_rule.add(node)
        strats = [Strategy(tuple(R if v is not None else None for v in out_vals(node)), tuple(R for _ in ins))]
    strats = [s for s in strats if _justified(s, reach) or _rows_justified(node, s, rows)]
    if node.target in FILLED_FACTORIES:  # a tensor of one value, made in a sharded layout a later op
        # asks for (the zeros of a selection's gradient): a free slice, without the whole tensor
        asked = sorted((q for q in wanted.get((node, 0), ()) if is_shard(q)), key=str)
        strats = strats + [Strategy((q,), s.ins) for q in asked for s in strats if s.outs[0] == R]
    strats = _forced(node, strats, ctx.options.attention, ctx.n)
    c.strategies[node] = strats
    for i, v in enumerate(out_vals(node)):
        if v is not None:
            c.reach[(node, i)] = frozenset(s.outs[i] for s in strats)


def _wants(gm: fx.GraphModule, c: Candidates, ctx: SpContext) -> tuple[dict, dict]:
    """Placements later ops ask of each value that propagation did not reach, carried back
    through the ops that could produce them from another layout of their inputs: what attention
    heads ask (``introduces``), and the rows sequence-sharded attention asks of a mask that no
    sharded input reached (``rows``: those requests alone, carried back the same way)."""
    heads: dict[Key, set] = defaultdict(set)
    masks: dict[Key, set] = defaultdict(set)
    for node, strats in c.strategies.items():
        for s in strats:
            for key, q in zip(tensor_inputs(node), s.ins):
                if q in c.reach[key]:
                    continue
                if s.introduces:
                    heads[key].add(q)
                elif s.kernel in ATTENTION_KERNELS and is_shard(q) and not _activation(c.reach[key]):
                    masks[key].add(q)
    heads = _carried_back(gm, c, ctx, heads)
    masks = {
        k: frozenset(filter(is_shard, v))
        for k, v in _carried_back(gm, c, ctx, masks, even=False).items()
        if not _activation(c.reach[k])
    }
    wanted = {k: heads.get(k, frozenset()) | masks.get(k, frozenset()) for k in heads.keys() | masks.keys()}
    return wanted, masks


def _blocks(size: int, sf: int, n: int) -> bool:
    """A non-empty dim of ``size`` splits into ``sf`` blocks (each over the ranks, unevenly)."""
    return size > 0 and size % sf == 0


def _carried_back(gm: fx.GraphModule, c: Candidates, ctx: SpContext, wanted: dict, even: bool = True) -> dict:
    """``wanted`` (value -> placements asked of it), with what the ops producing them would ask of
    their own inputs to produce them (in splits that are even, unless not ``even``: a mask's rows
    split as unevenly as the sequence does)."""
    n = ctx.n
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function":
            continue
        ins = tensor_inputs(node)
        for i in range(len(out_vals(node))):
            for p in sorted(wanted.get((node, i), ()), key=str):
                sfs = {1} | ({shard_spec(p)[1]} if is_shard(p) else set())
                A = [
                    frozenset(
                        [R, P]
                        + [
                            shard(d, sf)
                            for d in range(out_vals(u)[j].ndim)
                            for sf in sorted(sfs)
                            if (can_shard if even else _blocks)(out_vals(u)[j].shape[d], sf, n)
                        ]
                    )
                    for u, j in ins
                ]
                for s in strategies_for(node, A, n, ctx.mesh) or []:
                    if s.outs[i] == p:
                        for key, q in zip(ins, s.ins):
                            if q != R and q not in c.reach[key]:
                                wanted[key].add(q)
    return {k: frozenset(v) for k, v in wanted.items()}
