"""The plan ``autosp.explain`` returns: every node's placement and every inserted collective."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._context import Kernel
from .._graph import hint, is_attention, is_attention_backward, nbytes, op_args, out_vals, tensor_inputs
from ..errors import source_line
from ..partition._checkpoint import Checkpoint
from ..partition._fsdp import fsdp_notes
from ..partition._memory import MemoryEstimate
from ..propagate._attention import attention_notes
from ..propagate._flex import FLEX, flex_args, is_flex
from ..propagate._placement import R, redistribute_kind, transfer_bytes
from ..propagate._solver import Choice

__all__ = ["COMPILE_PHASES", "Collective", "Plan", "build_plan", "timing_line"]

aten = torch.ops.aten

# a compile's phases, in order: Dynamo's and AOTAutograd's capture of the step, autosp's passes,
# the backend compiler (Inductor, or aot_eager's wrapping) on the forward and the backward
COMPILE_PHASES = ("capture", "propagate", "solve", "localize", "checkpoint", "compile")


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
    # why a hand-written Ulysses plan of the same attention would not send it ("" where it would:
    # the attention's all-to-alls, the gradients' and the loss's all-reduces)
    beyond: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    """What one compile decided (``autosp.explain``, ``step.plan``): each node's placements, each
    collective, the notes on choices worth knowing, the predicted memory and the checkpointing
    rung. Against a hand-written Ulysses plan of the same attention (``ulysses_bytes``):
    ``activation_bytes`` is what this plan sends for activations and ``beyond_ulysses`` the
    collectives Ulysses would not send, each with its reason (``Collective.beyond``; a note sums
    them). ``timings``: where the compile's time went (``COMPILE_PHASES``), one line of it logged
    at INFO on logger ``autosp`` when the compile is done."""

    sp: int
    placements: dict[str, tuple[str, ...]]
    collectives: tuple[Collective, ...]
    mem_bytes: float
    notes: tuple[str, ...] = ()  # choices worth knowing: uneven splits, attention not run as Ulysses
    memory: MemoryEstimate | None = None  # predicted per rank, from the partitioned graphs
    checkpoint: Checkpoint | None = None
    # what a hand-written Ulysses plan of the same attention ops sends per rank: each attention's
    # Q, K, V and output all-to-all in the forward, their gradients' in the backward
    ulysses_bytes: float = 0.0
    # where this compile's time went, in seconds (``COMPILE_PHASES``), filled in as it goes: the
    # backend's compile of the backward may come at the first backward
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def compile_seconds(self) -> float:
        """This compile's time so far (``timings``' sum)."""
        return sum(self.timings.values())

    @property
    def comm_bytes(self) -> float:
        return sum(c.bytes_per_rank for c in self.collectives)

    @property
    def activation_bytes(self) -> float:
        """Bytes sent per rank for activations: all but the gradients' and the loss's all-reduces
        (which any data- or sequence-parallel plan sends alike)."""
        return sum(c.bytes_per_rank for c in self.collectives if c.beyond or c.kind == "all_to_all")

    @property
    def beyond_ulysses(self) -> tuple[Collective, ...]:
        """The collectives a hand-written Ulysses plan of the same attention would not send."""
        return tuple(c for c in self.collectives if c.beyond)

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
        tail += [timing_line(self.timings)] if self.timings else []
        return "\n".join([head] + lines + [f"note: {x}" for x in self.notes] + tail)


def timing_line(times: dict[str, float]) -> str:
    """'compiled in 12.3 s: capture 4.1 s, propagate 1.0 s, ...': a compile's phases in order."""
    parts = [(k, times[k]) for k in COMPILE_PHASES if k in times]
    done = "compiled" if "compile" in times else "planned"  # explain stops before the backend's compile
    return f"{done} in {sum(v for _, v in parts):.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts)


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
    row per ring or hybrid attention op, for the exchanges inside its kernel), and the notes. An
    sp group of one rank has none: the per-rank graph drops its collectives (``drop_lone_collectives``)."""
    plan = choice.strategy
    backward = _backward_nodes(joint)
    placements = {nd.name: tuple(str(p) for p in s.outs if p is not None) for nd, s in plan.items()}
    colls, at = [], []  # the collectives, and the op each is for (None: the step's output)
    out_node = joint.graph.output_node()
    consumers = [(nd, tensor_inputs(nd), plan[nd].ins) for nd in joint.graph.nodes if nd in plan and n > 1]
    leaves = [a for a in torch.utils._pytree.tree_leaves(out_node.args) if isinstance(a, fx.Node)]
    consumers += [(out_node, [(a, 0) for a in leaves], tuple(R for _ in leaves))] if n > 1 else []
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
            at.append(nd if nd is not out_node else None)
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
            at.append(nd if nd is not out_node else None)
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
            at.append(nd if nd is not out_node else None)
    colls, ulysses = _against_ulysses(joint, backward, list(zip(colls, at)), n)
    notes = (
        *notes,
        *attention_notes(joint, plan, n),
        *fsdp_notes(joint),
        *_gather_notes(colls, _gathering(joint, plan)),
    )
    built = Plan(n, placements, tuple(colls), choice.mem_bytes, notes, ulysses_bytes=ulysses)
    return dataclasses.replace(built, notes=notes + _ulysses_note(built))


_SOFTMAX = (aten._softmax.default, aten._safe_softmax.default)


def _is_bmm(nd: fx.Node) -> bool:
    return nd.op == "call_function" and nd.target == aten.bmm.default


def _scores_bmm(softmax: fx.Node) -> fx.Node | None:
    """The batched matmul that makes a softmax's scores (Q K^T), through its scaling and mask."""
    nd = softmax
    for _ in range(8):
        nd = nd.args[0] if nd.args and isinstance(nd.args[0], fx.Node) else None
        if nd is None or _is_bmm(nd):
            return nd
    return None


def _mixing_bmm(softmax: fx.Node, backward: set[fx.Node]) -> fx.Node | None:
    """The forward batched matmul that mixes V by a softmax's probabilities (P V)."""
    chain, frontier = {softmax}, [softmax]
    for _ in range(6):
        frontier = [u for nd in frontier for u in nd.users if u not in backward and u not in chain]
        for u in frontier:
            if _is_bmm(u) and u.args[0] in chain:
                return u
        chain.update(frontier)
    return None


@dataclass(frozen=True, slots=True)
class _Attention:
    """One attention of the forward: what Ulysses moves of its Q, K, V and output (elements, and
    bytes per element), and where it runs in the graph in each pass (node positions: the forward
    op; the first backward op reading Q)."""

    numels: tuple[int, ...]
    itemsizes: tuple[int, ...]
    forward: int
    backward: int


# ops between K or V and an attention that reads them repeated to the query heads
# (``repeat_kv``: unsqueeze, expand, clone, reshape; the matmuls' views)
_REPEAT_CHAIN = {
    aten.expand.default,
    aten.clone.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.transpose.int,
    aten.permute.default,
    aten.alias.default,
}


def _chain(nd: fx.Node) -> list:
    """The fake tensors up the chain of views and expands that ends at ``nd`` (``nd``'s first)."""
    vals = [out_vals(nd)[0]]
    for _ in range(10):
        if nd.op != "call_function" or nd.target not in _REPEAT_CHAIN or not isinstance(nd.args[0], fx.Node):
            break
        nd = nd.args[0]
        vals.append(out_vals(nd)[0])
    return [v for v in vals if v is not None]


def _ulysses_kv(k: fx.Node, q: fx.Node, n: int) -> int:
    """The elements of K (or V) Ulysses moves: as they were before a repeat to the query heads (the
    smallest tensor up the chain of views and expands that feeds the attention), but at least one
    head per rank where the K/V heads are fewer than the ranks (Ulysses repeats them to n)."""
    read = hint(_chain(k)[0].numel())
    heads = next((hint(v.shape[1]) for v in _chain(q) if v.ndim == 4), None)  # Q as (B, H, L, D)
    floor = read * min(n, heads) // heads if heads else 0
    return max(min(hint(v.numel()) for v in _chain(k)), floor)


def _attentions(joint: fx.GraphModule, backward: set[fx.Node], n: int) -> list[_Attention]:
    """Every attention in the forward: the SDPA ops, and attention written by hand (a batched
    matmul, a softmax, a batched matmul)."""
    pos = {nd: i for i, nd in enumerate(joint.graph.nodes)}
    found = []
    for nd in joint.graph.nodes:
        if nd.op != "call_function" or nd in backward:
            continue
        if (is_attention(nd.target) and not is_attention_backward(nd.target)) or nd.target is FLEX:
            operands, out = nd.args[:3], nd
        elif nd.target in _SOFTMAX:
            scores, mixed = _scores_bmm(nd), _mixing_bmm(nd, backward)
            if scores is None or mixed is None:
                continue
            operands, out = (*scores.args[:2], mixed.args[1]), mixed
        else:
            continue
        q, k, v = operands
        vals = [out_vals(x)[0] for x in (q, k, v, out)]
        if any(t is None for t in vals):
            continue
        numels = (hint(vals[0].numel()), _ulysses_kv(k, q, n), _ulysses_kv(v, q, n), hint(vals[3].numel()))
        grads = [pos[u] for u in q.users if u in backward]
        found.append(_Attention(numels, tuple(t.element_size() for t in vals), pos[out], min(grads, default=len(pos))))
    return found


def _against_ulysses(joint: fx.GraphModule, backward: set[fx.Node], colls: list, n: int) -> tuple[list, float]:
    """``colls`` with what a hand-written Ulysses plan of the same attention would not send marked
    (``Collective.beyond``, the reason), and that plan's bytes per rank: each attention's Q, K, V
    and output all-to-all in the forward and their gradients in the backward, the gradients'
    all-reduces, the loss's. An all-to-all of another size, an all-gather, a halo exchange, a
    ring's K/V or a reduction of an activation is beyond it (``_ulysses_all_to_alls``)."""
    attentions = _attentions(joint, backward, n)
    moved = [numel * item for a in attentions for numel, item in zip(a.numels, a.itemsizes)]
    ulysses = sum(2 * transfer_bytes("all_to_all", b, n) for b in moved)
    pos = {nd: i for i, nd in enumerate(joint.graph.nodes)}
    at = [pos.get(consumer, len(pos)) for _, consumer in colls]
    matched = _ulysses_all_to_alls([c for c, _ in colls], at, attentions)
    primals = (out_vals(nd)[0] for nd in joint.graph.find_nodes(op="placeholder"))
    params = {tuple(v.shape) for v in primals if v is not None}
    out = []
    for i, (c, consumer) in enumerate(colls):
        numel = math.prod(c.shape)
        gradient = c.kind == "all_reduce" and (numel <= 1 or (c.backward and c.shape in params))
        if i not in matched and not gradient:  # not the loss's, a count's or a parameter gradient's
            c = dataclasses.replace(c, beyond=_why(c, consumer))
        out.append(c)
    return out, ulysses


def _ulysses_all_to_alls(colls: list[Collective], at: list[int], attentions: list[_Attention]) -> set[int]:
    """The indices of ``colls`` (each read at node position ``at``) that are all-to-alls Ulysses
    sends too, each matched once to what it moves of one attention in its pass, the nearest
    attention first: by size to a Q or output, then to a K or V, then to several of one attention's
    at once (a fused QKV projection's), then to a K or V it divides (K/V moved smaller than
    ``_ulysses_kv`` found them: a repeat it does not see through)."""
    entries = {}  # (pass, attention, operand) -> size; operands 1, 2: K, V
    for a, att in enumerate(attentions):
        for j, numel in enumerate(att.numels):
            for backward in (False, True):
                entries[(backward, a, j)] = numel
    todo = {i: c for i, c in enumerate(colls) if c.kind == "all_to_all"}

    def candidates(i: int, group: int, kv: bool | None):
        """Groups of ``group`` operands of one attention (only K and V, or only Q and the
        output, where ``kv`` says), the nearest attention first."""
        backward = todo[i].backward
        near = lambda a: abs(at[i] - (attentions[a].backward if backward else attentions[a].forward))  # noqa: E731
        free = [k for k in entries if k[0] == backward and (kv is None or (k[2] in (1, 2)) == kv)]
        by_attention: dict[int, list] = {}
        for k in sorted(free, key=lambda k: (near(k[1]), k)):
            by_attention.setdefault(k[1], []).append(k)
        return (combo for ks in by_attention.values() for combo in itertools.combinations(ks, group))

    def take(fits: Callable[[int, int], bool], group: int = 1, kv: bool | None = None) -> None:
        for i in list(todo):
            numel = math.prod(todo[i].shape)
            combo = next((c for c in candidates(i, group, kv) if fits(numel, sum(entries[k] for k in c))), None)
            if combo is not None:
                for k in combo:
                    del entries[k]
                del todo[i]

    same = lambda numel, size: numel == size  # noqa: E731
    take(same, kv=False)
    take(same, kv=True)
    for group in (2, 3, 4):
        take(same, group)
    take(lambda numel, size: size % numel == 0 and size // numel <= 128, kv=True)
    return {i for i, c in enumerate(colls) if c.kind == "all_to_all"} - set(todo)


def _why(c: Collective, consumer: fx.Node | None) -> str:
    """Why a hand-written Ulysses plan would not send ``c``."""
    at = f"{c.op} at {c.source}"
    return {
        "all_to_all": f"{c.producer} re-split {c.src}->{c.dst} for {at}, beside the attention's exchanges",
        "all_gather": f"{c.producer} all-gathered for {at}" + _operand(consumer, c.producer),
        "halo": f"the neighbouring rank's rows of {c.producer} read by {at} (a shift or window along the sequence)",
        "ring": f"K/V passed around the ranks at {c.source}, in place of Ulysses' all-to-alls (its note says why)",
        "hybrid": f"K/V passed around the sub-groups at {c.source}, after all-to-alls within them (its note says why)",
        "merge": f"the ranks' results of {at} combined",
    }.get(c.kind, f"a partial sum of {c.producer} ({c.src}) reduced for {at}")


def _operand(consumer: fx.Node | None, producer: str) -> str:
    """', its mask: ...' where an attention op reads the value as its mask or bias."""
    if consumer is None or not is_attention(consumer.target):
        return ""
    names = [k for k, v in op_args(consumer).items() if isinstance(v, fx.Node) and v.name == producer]
    if not names or names[0] in ("query", "key", "value"):
        return ""
    return (
        f" as its {names[0]}: each rank's heads read every query row and key of it (a causal mask passed as "
        "is_causal=True moves nothing)"
    )


def _ulysses_note(plan: Plan) -> tuple[str, ...]:
    """The plan's activation bytes against Ulysses', and what it sends beyond, grouped by reason."""
    if not plan.ulysses_bytes:
        return ()
    act, ulysses = plan.activation_bytes, plan.ulysses_bytes
    head = (
        f"activations: {act / 2**20:.3f} MiB sent per rank, {act / ulysses:.2f}x a hand-written Ulysses plan of the "
        f"same attention ({ulysses / 2**20:.3f} MiB)"
    )
    groups: dict[tuple[str, str], list[Collective]] = {}
    for c in plan.beyond_ulysses:
        groups.setdefault((c.kind, c.beyond), []).append(c)
    if not groups:
        return (head,)
    rows = (f"{k} x{len(cs)} {sum(c.bytes_per_rank for c in cs) / 2**20:.3f} MiB: {w}" for (k, w), cs in groups.items())
    return (head + "; beyond it: " + "; ".join(rows),)


def _gathering(joint: fx.GraphModule, plan) -> set[tuple[str, str]]:
    """(attention op, its key or value) of each op the plan runs against all-gathered K/V (their
    notes say why K/V are gathered)."""
    out = set()
    for nd in joint.graph.nodes:
        if nd in plan and plan[nd].kernel == Kernel.KV_GATHER:
            args = flex_args(nd.target, nd.args) if is_flex(nd.target) else op_args(nd)
            out |= {(nd.name, args[k].name) for k in ("key", "value") if isinstance(args.get(k), fx.Node)}
    return out


def _gather_notes(colls: list[Collective], gathering: set[tuple[str, str]] = frozenset()) -> list[str]:
    """Why each sharded value is all-gathered: the op that reads it whole, or the step returning it
    (the K/V of ``gathering``'s (op, key or value) are said in the attention's notes)."""

    def why(c: Collective) -> str | None:
        what = f"{c.producer} ({'x'.join(map(str, c.shape))} {c.dtype}, {c.src}) is all-gathered"
        if (c.consumer, c.producer) in gathering:
            return None
        if c.consumer == "output":
            return (
                f"{what}: the step returns it (made by {c.op} at {c.source}), whole on every rank as "
                "one device returns it; returning a reduction of it (a sum, a mean) keeps it split"
            )
        if c.op.startswith(("aten.split", "aten.chunk", "aten.unsafe_split")):
            return (
                f"{what} for {c.op} at {c.source}: a split along the sequence into chunks (a head or loss "
                "computed chunk by chunk) puts each chunk's rows on several ranks. autosp runs the chunks as "
                "one where each goes through the same row-local ops and they are concatenated or summed; "
                "these are not (ops that differ by chunk, such as a slice of the last one, or a chunk read "
                "elsewhere), so computing it on the whole tensor is the fix (the checkpointing pass tiles a "
                "loss by memory), or autosp.annotate(x, 'R') to make the gather explicit"
            )
        return (
            f"{what} for {c.op} at {c.source}: no exact strategy of that op keeps it {c.src} (it reads the "
            "sharded dim whole: e.g. x.max(dim), a product or a flip along the sequence, or an op without a "
            "rule on integer data); computing it another way, or autosp.annotate(x, 'R') to make the "
            "gather explicit, is the fix"
        )

    return [w for w in (why(c) for c in colls if c.kind == "all_gather") if w is not None]
