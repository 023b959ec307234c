"""Activation checkpointing on the per-rank joint graph: which forward results the backward
keeps and which it recomputes, decided from a cost model and handed to AOTAutograd's min-cut
partitioner as ``node.meta["recompute"]`` tags (per-layer regions in ``ac_graph_id``).

The candidates form a ladder. Every forward op inside a repeated block (a layer: a module that
is an item of a ModuleList) gets a recompute cost per byte it would keep: flops (torch's flop
counter) plus the bytes it writes times the machine balance. Rung k recomputes the ops whose
cost per byte is at most the k-th threshold; the last rung, ``full``, recomputes every op of the
layers, as per-layer ``torch.utils.checkpoint`` does, except three kinds that no rung recomputes:
attention (its recompute grows with the square of the sequence, its output and log-sum-exp only
linearly), collectives (the partitioner force-saves them: communication per step never grows)
and random ops (their draws would differ; the SDPA ops carry torch's random tag for dropout and
would take the partitioner's RNG-state path).
Past "full", two rungs run on the graph tiled along the sequence (``_tiling``: one tile of the
MLP, the projections, the vocabulary projection and their gradients alive at a time):
"full, N tiles", and "full + loss, N tiles", which also recomputes the ops after the last layer
(final norm, vocabulary projection, loss), tile by tile, instead of keeping the logits. They are
built where the local sequence holds two tiles of ``MIN_TILE_ROWS`` and the policy may take them.
With ``shard(offload=True)`` each rung that recomputes every layer op has an offloaded twin, its
saved layer activations in host memory between the forward and the backward (``_offload``).
Budgets (and ``every_rung``) also weigh "whole layers" rungs, untiled and tiled: every layer op
recomputed from the layer's input, attention and collectives included, as per-layer
``torch.utils.checkpoint`` does; they send the layers' collectives again, so "auto" and "full"
never take them. Each rung's memory is predicted from its partitioned graphs (under "auto", but for the first and
the one taken, priced from the first's: ``_Priced``); the policy picks one:

- ``"none"``: the partitioner's own choice (torch.compile's default); recompute tags the model
  set itself (``torch.utils.checkpoint`` inside the step) are replaced under every policy;
- ``"full"``: the least memory of the rungs that recompute every layer op ("full" and the tiled
  and offloaded ones; reported under the name of the last threshold rung when that one already
  tags the same ops; on a symbolic length read at ``AUTO_LONGER`` times the first length, as
  "auto" reads it);
- ``"auto"``: the least memory (whole layers aside) whose recompute costs at most
  ``AUTO_OVERHEAD`` of the step (on a symbolic length, both read at ``AUTO_LONGER`` times the
  first length: one rung serves every length, and it is the one that holds memory down where
  memory runs out);
- an int: a budget in bytes per rank for the step's peak beyond parameters and optimizer
  state; the cheapest rung that fits, or an error naming the smallest budget that fits.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._functorch import partitioners
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

from .._context import check_policy
from .._devices import device as accelerator
from .._graph import graph_module, hint, is_attention, is_attention_backward, op_args, out_bytes, out_vals
from .._repeats import block_of, repeated_blocks
from ..errors import PlanError
from ..propagate._flex import FLEX_BACKWARD, flex_args, is_flex
from ._fsdp import GATHER as _FSDP_GATHER
from ._fsdp import fsdp_tags
from ._memory import MemoryEstimate, _nbytes, at_length, estimate_memory, sequence_peak
from ._offload import offload_saved

__all__ = ["Balance", "Checkpoint", "Rung", "RungSpec", "checkpoint_partition", "select"]

# flops a CPU core does in the time it writes one byte of a pointwise op's output: 132.6 GFLOP/s
# (4096x256 @ 256x768 fp32 matmul) against 7.4 GB/s (4096x768 multiply), one thread, this machine
MACHINE_BALANCE = 16.0


@dataclass(frozen=True, slots=True)
class Balance:
    """How the pass weighs a byte against a flop: ``written``, the flops the device does in the
    time it writes one byte of memory (its machine balance: a recomputed op costs its flops plus
    this times its bytes); ``copied``, in the time one byte crosses the host link (an offloaded
    activation's copy out or back). This CPU's by default; a device's from its public figures
    (``Options.device``, ``_devices.DEVICES``): an H100's 295 and 15,450 flop/B, against 16 and 16."""

    written: float = MACHINE_BALANCE
    copied: float = MACHINE_BALANCE

    @classmethod
    def of(cls, device: str | None) -> Balance:
        if device is None:
            return cls()
        dev = accelerator(device)
        return cls(dev.balance, dev.bf16_flops / dev.host_bandwidth)


# "auto" spends at most this fraction of the step's estimated cost on recomputation: the step
# time the default may cost (measured, small preset at 8192 tokens over 2: the "full" rung,
# estimated +8.9%, ran +6% for half the memory; tests/memory_probe.py)
AUTO_OVERHEAD = 0.10
# on a symbolic length, "auto" weighs each rung's peak and overhead at this many times the length
# the compile is first called with (the rungs tie at short lengths, where the gradients'
# buffers make the peak: small preset, 64 tokens over 2, every rung 6.5 MiB; at 4096 tokens
# they are 77 to 40 MiB), and takes the rung for every length
AUTO_LONGER = 16
# what reading a size at another length raises: a size with another symbol in it (a
# data-dependent count's), or one that has no value there
_UNREAD = (TypeError, ValueError, ZeroDivisionError)
RUNGS = 5  # rungs between "none" and "full", at quantiles of the ops' cost per byte

aten = torch.ops.aten
log = logging.getLogger("autosp")
Tags = dict[str, CheckpointPolicy]  # node name -> recompute tag


@dataclass(frozen=True, slots=True)
class RungSpec:
    """What a rung recomputes: nothing (``kind`` "none"), the layer ops whose recompute costs at
    most ``threshold`` flop-equivalents per byte kept ("threshold"), every layer op but attention
    and collectives ("full"), or every one ("layers": whole layers, from their inputs), with
    ``loss`` also the ops after the last layer; on a graph tiled in ``tiles`` along the
    sequence (1: untiled; the most tiles of a group of ops, with ``fewest`` the fewest where
    groups differ, ``_tiling._caps``)."""

    kind: str
    threshold: float | None = None
    loss: bool = False
    tiles: int = 1
    fewest: int = 0
    offload: bool = False  # the layers' saved activations in host memory (``_offload``)

    @property
    def name(self) -> str:
        """'none', 'recompute <= 16 flop/B', 'full', 'whole layers + loss, 8 tiles, offloaded',
        'full + loss, 8-64 tiles'."""
        if self.kind == "threshold":
            base = f"recompute <= {self.threshold:.3g} flop/B"
        else:
            base = ("whole layers" if self.kind == "layers" else self.kind) + (" + loss" if self.loss else "")
        counts = f"{self.fewest}-{self.tiles}" if 0 < self.fewest < self.tiles else str(self.tiles)
        return base + (f", {counts} tiles" if self.tiles > 1 else "") + (", offloaded" if self.offload else "")

    @property
    def key(self) -> tuple:
        """The same rung at another length (whose tile count may differ)."""
        return self.kind, self.threshold, self.loss, self.tiles > 1, self.offload


@dataclass(frozen=True, slots=True)
class Rung:
    """One candidate: its predicted memory, and the estimated cost (flop-equivalents) of what its
    backward recomputes against the cost of the whole step without recomputation."""

    spec: RungSpec
    memory: MemoryEstimate
    recompute: float
    step: float
    attention: float = 0.0  # the part of ``step`` spent in attention (quadratic in the sequence)
    # on a symbolic length: (length, predicted peak, overhead) at the length "auto" decides at
    # (``AUTO_LONGER``), read from the same graphs; None elsewhere
    longer: tuple[int, int, float] | None = None
    # priced from another rung's partition (``_Priced``), not partitioned itself
    priced: bool = False
    # the step's matmul and attention flops and the bytes its ops write, without recomputation
    # (``_Ladder.work``): a device's time for it (``autosp plan --device``)
    flops: float = 0.0
    written: float = 0.0
    # bytes per rank the backward's recomputed collectives send (whole layers), beyond the plan's
    comm: float = 0.0
    # the part of ``recompute`` that recomputes attention (whole layers)
    recompute_attention: float = 0.0
    copied: float = MACHINE_BALANCE  # flop-equivalents of a byte's copy to the host (``Balance``)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def overhead(self) -> float:
        return self.recompute / max(self.step, 1.0)

    @property
    def copies(self) -> float:
        """The part of ``overhead`` an offloaded rung's copies to the host and back make (its
        ``memory.host`` bytes, each written twice)."""
        return 2 * self.memory.host * self.copied / max(self.step, 1.0)

    @property
    def weighed(self) -> tuple[int, float]:
        """(peak, overhead) as "auto" weighs them: at the longer length where there is one."""
        return self.longer[1:] if self.longer is not None else (self.memory.peak, self.overhead)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The checkpointing decision of one compile: the policy asked for, the rung taken, every
    rung evaluated, and whether the policy weighed tiled rungs (had the graph tiles or not: the
    one case in which the tile count matters to the decision)."""

    policy: str
    rung: Rung
    rungs: tuple[Rung, ...]
    weighs_tiles: bool = False
    # a budget on a symbolic length: (the length's symbol, lo, hi), the lengths at which the
    # rung taken is the one the budget takes (None: no bound that side); the caller guards them
    lengths: tuple | None = None
    # why the rungs are fewer than the policy asks for (no repeated blocks found), or ""
    note: str = ""

    @property
    def chosen(self) -> str:
        return self.rung.name

    @property
    def memory(self) -> MemoryEstimate:
        return self.rung.memory

    def __str__(self) -> str:
        # a ladder keeps repeated thresholds (every rank the same count); each rung is shown once
        shown: dict[str, Rung] = {}
        for r in self.rungs:
            shown.setdefault(r.name, r)
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        rows = ", ".join(
            f"{r.name}: {'~' if r.priced else ''}{mib(r.memory.peak)}, +{r.overhead:.1%}"
            + (f" ({mib(r.longer[1])}, +{r.longer[2]:.1%} at {r.longer[0]})" if r.longer else "")
            for r in shown.values()
        )
        longer = _longer(_unsent(self.rungs)) if self.policy in ("auto", "full") else None
        at = f" (weighed at {longer} tokens, for every length)" if longer else ""
        priced = "; ~: priced from the first rung's partition" if any(r.priced for r in self.rungs) else ""
        return f"checkpoint={self.policy}: chose {self.chosen!r}{at} of [{rows}]{priced}" + (
            f"; {self.note}" if self.note else ""
        )


def _unsent(rungs) -> list:
    """The rungs that send nothing again (all but whole layers: a budget's only)."""
    return [r for r in rungs if r.spec.kind != "layers"]


def _longer(rungs) -> int | None:
    """The longer length every rung was weighed at as well, if every one was."""
    lengths = {r.longer[0] if r.longer is not None else None for r in rungs}
    return lengths.pop() if len(lengths) == 1 else None


def select(policy, rungs: list[Rung], peaks: list[int] | None = None) -> Rung:
    """The rung ``policy`` takes (see the module docstring). ``peaks``: each rung's peak to hold
    a budget against (the largest over the ranks), by default the rung's own prediction."""
    if policy == "none":
        return rungs[0]
    if policy == "full":  # the least memory of the rungs that recompute every layer op (as "auto" weighs it)
        full = [r for r in rungs if r.spec.kind == "full"] or rungs[-1:]
        peak = (lambda r: r.weighed[0]) if _longer(full) else (lambda r: r.memory.peak)
        return min(full, key=lambda r: (peak(r), r.recompute))
    if policy == "auto":  # at the longer length where every rung has one (a symbolic length)
        rungs = _unsent(rungs)
        weigh = (lambda r: r.weighed) if _longer(rungs) else (lambda r: (r.memory.peak, r.overhead))
        fits = [r for r in rungs if weigh(r)[1] <= AUTO_OVERHEAD] or rungs[:1]
        return min(fits, key=weigh)
    # a budget: the first rung that fits (the ladder recomputes more at each rung), by index, so
    # that every rank takes the same one (each holds its own rungs against the ranks' largest peaks)
    peak = dict(zip(map(id, rungs), peaks or [r.memory.peak for r in rungs]))
    fits = [r for r in rungs if peak[id(r)] <= policy]
    if not fits:
        smallest = min(rungs, key=lambda r: peak[id(r)])
        need = peak[id(smallest)]
        raise PlanError(
            None,
            f"no checkpointing plan fits checkpoint={policy} bytes per rank: the smallest predicted "
            f"peak is {need} bytes ({need / 2**20:.1f} MiB, rung {smallest.name!r}, on the rank that "
            f"needs most; here: {smallest.memory})",
            f"pass checkpoint={need} or more, use more sp ranks, or a shorter sequence",
        )
    return fits[0]


def _attention_flops(nd: fx.Node, read: Callable = hint) -> float:
    """torch's flop counter has no formula for the CPU attention kernels: 4·B·H·Sq·Sk·D forward
    (half of it causal; FlexAttention's whole, its block sparsity being data), 2.5 times that
    backward (recomputed scores, four matmuls). ``read``: how sizes are read (at their hints;
    ``at_length`` for another length)."""
    if is_flex(nd.target):  # its block mask's sparsity is data: counted dense
        args = flex_args(nd.target, nd.args)
        q, k = args["query"].meta["val"], args["key"].meta["val"]
        flops = 4.0 * read(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3])
        return flops * (2.5 if nd.target is FLEX_BACKWARD else 1.0)
    args = op_args(nd)
    q, k = args["query"].meta["val"], args["key"].meta["val"]
    # ring and hybrid attention (``autosp::ring_attention``): this rank's rows against all S keys
    # (a node of the graph where the length is symbolic)
    keys = args.get("S", k.shape[2])
    keys = keys.meta["val"] if isinstance(keys, fx.Node) else keys
    flops = 4.0 * read(q.shape[0] * q.shape[1] * q.shape[2] * keys * q.shape[3])
    causal = bool(args["is_causal"])
    return flops * (0.5 if causal else 1.0) * (2.5 if is_attention_backward(nd.target) else 1.0)


_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1), aten.baddbmm.default: (1, 2)}


def _flops(nd: fx.Node, read: Callable = hint) -> float:
    """Matmul and attention flops from the shapes (what torch's flop counter counts, without
    running each op on fake tensors: 4 ms a node); every other op counts by its bytes."""
    if nd.target in _MATMULS:
        i, j = _MATMULS[nd.target]
        a, b = nd.args[i].meta["val"], nd.args[j].meta["val"]
        return 2.0 * read(a.numel() * b.shape[-1])
    if is_attention(nd.target) or is_flex(nd.target):
        return _attention_flops(nd, read)
    return 0.0


def _cost(nd: fx.Node, read: Callable | None = None, balance: float = MACHINE_BALANCE) -> float:
    """A node's estimated cost, its sizes at their hints or read with ``read`` (``at_length``):
    its flops plus ``balance`` times the bytes it writes."""
    if read is None:
        return _flops(nd) + balance * out_bytes(nd)
    written = sum(read(math.prod(v.shape)) * v.element_size() for v in out_vals(nd) if v is not None)
    return _flops(nd, read) + balance * written


def _kind(nd: fx.Node) -> str:
    """'collective', 'random', 'attention', 'view', 'getitem' or 'compute'."""
    target = nd.target
    if target is operator.getitem:
        return "getitem"
    if is_flex(target):
        return "attention"
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace == "_c10d_functional":
            return "collective"
        if is_attention(target):
            return "attention"
        if torch.Tag.nondeterministic_seeded in target.tags:
            return "random"
        if target.is_view:
            return "view"
    return "compute"


def _forward_ops(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Forward call_function nodes inside repeated blocks -> their region."""
    forward = [
        nd for nd in gm.graph.nodes if nd.op == "call_function" and nd.meta.get("partitioner_tag") == "is_forward"
    ]
    blocks = repeated_blocks(forward)
    return {nd: region for nd in forward if (region := block_of(nd, blocks)) is not None}


def _head_ops(gm: fx.GraphModule, fwd: dict[fx.Node, str]) -> list[fx.Node]:
    """Forward ops outside the layers that depend on a layer's result: the final norm, the
    vocabulary projection and the loss (recomputed by the tiled rung, tile by tile)."""
    after: set[fx.Node] = set()
    for nd in gm.graph.nodes:
        if (
            nd.op == "call_function"
            and nd.meta.get("partitioner_tag") == "is_forward"
            and nd not in fwd
            and any(u in fwd or u in after for u in nd.all_input_nodes)
        ):
            after.add(nd)
    # only what the backward reads: the loss's own sum, tagged, would take its all-reduce along
    # into the backward (the partitioner keeps a collective whose input it has there)
    read: set[fx.Node] = set()
    for nd in reversed(gm.graph.nodes):
        if (
            nd.op == "call_function"
            and nd.meta.get("partitioner_tag") == "is_backward"
            or any(u in read for u in nd.users)
        ):
            read.add(nd)
    return [nd for nd in gm.graph.nodes if nd in after and nd in read]


def _graph_copy(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of ``gm`` whose nodes have the same names and their own meta dicts (the values in
    them shared)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old, new in env.items():
        new.meta = dict(old.meta)
    return graph_module(gm, graph), env


def _tagged_copy(gm: fx.GraphModule, tags: dict[str, CheckpointPolicy], regions: dict[str, int]) -> fx.GraphModule:
    copy, env = _graph_copy(gm)
    for old, new in env.items():
        new.meta.pop("recompute", None)
        new.meta.pop("ac_graph_id", None)
        if old.name in tags:
            new.meta["recompute"] = tags[old.name]
            new.meta["ac_graph_id"] = regions[old.name]
    copy.graph.lint()
    return copy


def _attention_merges(fwd: dict[fx.Node, str], kinds: dict[fx.Node, str]) -> set[fx.Node]:
    """The ops that merge blockwise attention results (ring attention, gathered K/V): compute
    ops fed, without a view between, by an attention kernel's output or log-sum-exp and of the
    same size. They make the attention output: kept, like the kernel's own, or recomputing them
    would save every block's partial output instead."""
    out: set[fx.Node] = set()
    todo = [
        (g, hint(g.meta["val"].numel()))
        for nd in fwd
        if kinds[nd] == "attention"
        for g in nd.users
        if kinds.get(g) == "getitem" and isinstance(g.meta.get("val"), torch.Tensor)
    ]
    while todo:
        nd, numel = todo.pop()
        for u in nd.users:
            if (
                u not in out
                and kinds.get(u) == "compute"
                and isinstance(u.meta.get("val"), torch.Tensor)
                and hint(u.meta["val"].numel()) == numel
            ):
                out.add(u)
                todo.append((u, numel))
    return out


def _layer_tags(
    gm: fx.GraphModule, cost: dict[str, float], tiles: tuple[int, int]
) -> tuple[list[tuple[RungSpec, Tags]], dict[str, int]]:
    """The rungs (what each recomputes, and its tags) and the region of each tagged op. On a tiled
    graph (``tiles``: its groups' fewest and most, > 1) the ladder also has "full + loss": "full"
    and the ops after the last layer (``_head_ops``); untiled, the recomputed logits would come back whole."""
    fwd = _forward_ops(gm)
    region_ids = {r: i for i, r in enumerate(dict.fromkeys(fwd.values()))}
    regions = {nd.name: region_ids[r] for nd, r in fwd.items()}
    fewest, most = tiles
    counts = {"tiles": most, "fewest": fewest} if most > 1 else {}
    head = _head_ops(gm, fwd) if most > 1 else []
    regions.update({nd.name: len(region_ids) for nd in head})
    kinds = {nd: _kind(nd) for nd in [*fwd, *head]}

    per_byte = {nd.name: cost[nd.name] / max(out_bytes(nd), 1) for nd in fwd if kinds[nd] == "compute"}
    merges = _attention_merges(fwd, kinds)
    keep = {nd.name: CheckpointPolicy.MUST_SAVE for nd in fwd if kinds[nd] in ("attention", "random") or nd in merges}
    views = {nd.name: CheckpointPolicy.PREFER_RECOMPUTE for nd in fwd if kinds[nd] == "view"}
    getitems = [nd for nd in [*fwd, *head] if kinds[nd] == "getitem"]

    def with_getitems(tags: Tags) -> Tags:
        # an output of a multi-output op follows the op: a tuple cannot be saved on its own
        return {**tags, **{nd.name: tags[nd.args[0].name] for nd in getitems if nd.args[0].name in tags}}

    rungs: list[tuple[RungSpec, Tags]] = [(RungSpec("none"), {})]
    ratios = sorted({float(f"{r:.2g}") for r in per_byte.values()})
    # RUNGS of them on every rank, repeats kept: ranks whose graphs differ (uneven shards) build
    # ladders of one length, which a budget compares rung by rung over the ranks
    thresholds = (
        [ratios[min(len(ratios) - 1, math.ceil(q * len(ratios)) - 1)] for q in [(k + 1) / RUNGS for k in range(RUNGS)]]
        if ratios
        else []
    )
    for t in thresholds:
        tags = {
            **keep,
            **views,
            **{name: CheckpointPolicy.PREFER_RECOMPUTE for name, r in per_byte.items() if float(f"{r:.2g}") <= t},
        }
        rungs.append((RungSpec("threshold", t, **counts), with_getitems(tags)))
    if not fwd:
        return rungs, regions
    full = {**{nd.name: CheckpointPolicy.PREFER_RECOMPUTE for nd in fwd if kinds[nd] in ("compute", "view")}, **keep}
    rungs.append((RungSpec("full", **counts), with_getitems(full)))
    head_tags = {
        nd.name: CheckpointPolicy.PREFER_RECOMPUTE if kinds[nd] in ("compute", "view") else CheckpointPolicy.MUST_SAVE
        for nd in head
        if kinds[nd] != "getitem"
    }
    if head_tags:
        rungs.append((RungSpec("full", loss=True, **counts), with_getitems({**full, **head_tags})))
    # whole layers: attention and collectives recomputed too (random ops kept: their draws)
    random = {nd.name: CheckpointPolicy.MUST_SAVE for nd in fwd if kinds[nd] == "random"}
    whole = {**{nd.name: CheckpointPolicy.PREFER_RECOMPUTE for nd in fwd if kinds[nd] != "getitem"}, **random}
    rungs.append((RungSpec("layers", **counts), with_getitems(whole)))
    if head_tags:
        rungs.append((RungSpec("layers", loss=True, **counts), with_getitems({**whole, **head_tags})))
    return rungs, regions


@dataclass(frozen=True)
class _Ladder:
    """The rungs of one per-rank joint graph (FSDP2's gathers tagged in every rung), the
    checkpoint region of each tagged op, and each op's estimated cost; with ``longer``, also at
    the length "auto" weighs rungs at on a symbolic length: (that length, its size reader, the
    costs there)."""

    graph: fx.GraphModule
    rungs: list[tuple[RungSpec, Tags]]
    regions: dict[str, int]
    cost: dict[str, float]
    longer: tuple[int, Callable, dict[str, float]] | None = None
    layers: frozenset[str] = frozenset()  # the forward ops inside the repeated blocks (not the head's)
    balance: float = MACHINE_BALANCE  # ``Balance.written``

    @classmethod
    def of(
        cls,
        gm: fx.GraphModule,
        tiles: tuple[int, int] = (1, 1),
        longer: tuple[int, Callable] | None = None,
        balance: float = MACHINE_BALANCE,
    ) -> _Ladder:
        ops = [nd for nd in gm.graph.nodes if nd.op == "call_function"]
        cost = {nd.name: _cost(nd, None, balance) for nd in ops}
        rungs, regions = _layer_tags(gm, cost, tiles)
        # FSDP2's parameter gathers: re-gathered in the backward (or kept) under every policy
        params = fsdp_tags(gm)
        regions = {**regions, **{k: region for k, (_, region) in params.items()}}
        rungs = [(spec, {**tags, **{k: tag for k, (tag, _) in params.items()}}) for spec, tags in rungs]
        if longer is not None:
            length, read = longer
            try:
                longer = (length, read, {nd.name: _cost(nd, read, balance) for nd in ops})
            except _UNREAD:
                longer = None
        return cls(gm, rungs, regions, cost, longer, frozenset(nd.name for nd in _forward_ops(gm)), balance)

    def cost_of(self, nd: fx.Node, longer: bool = False) -> float:
        """A node's cost (at the longer length); a backward node is named as the forward op it
        recomputes."""
        if longer:
            _, read, cost = self.longer
            return cost[nd.name] if nd.name in cost else _cost(nd, read, self.balance)
        return self.cost[nd.name] if nd.name in self.cost else _cost(nd, None, self.balance)

    def total(self, longer: bool = False) -> tuple[float, float]:
        """The estimated cost of the whole step without recomputation, and of its attention."""
        cost = self.longer[2] if longer else self.cost
        ops = [nd for nd in self.graph.graph.nodes if nd.op == "call_function"]
        return sum(cost[nd.name] for nd in ops), sum(cost[nd.name] for nd in ops if _kind(nd) == "attention")

    def written(self, longer: bool = False) -> float:
        """The estimated cost of the ops that compute (not views or getitems)."""
        cost = self.longer[2] if longer else self.cost
        return sum(
            cost[nd.name]
            for nd in self.graph.graph.nodes
            if nd.op == "call_function" and _kind(nd) not in ("view", "getitem")
        )

    @functools.cached_property
    def work(self) -> tuple[float, float]:
        """(matmul and attention flops, bytes written) of the step's ops that compute."""
        ops = [nd for nd in self.graph.graph.nodes if nd.op == "call_function" and _kind(nd) not in ("view", "getitem")]
        return sum(_flops(nd) for nd in ops), float(sum(out_bytes(nd) for nd in ops))

    def recompute_cost(self, fw: fx.GraphModule, bw: fx.GraphModule, tags: Tags, longer: bool = False) -> float:
        """What the backward recomputes (FSDP's parameter gathers are communication, as FSDP2 runs
        them in every setting, not activation recompute): its ops that the forward ran, and the
        attention ops ``tags`` recompute (``attention_again``)."""
        fw_names = {nd.name for nd in fw.graph.nodes if nd.op == "call_function"}
        return self.attention_again(tags, longer) + sum(
            self.cost_of(nd, longer)
            for nd in bw.graph.nodes
            if nd.op == "call_function"
            and nd.name in fw_names
            and nd.target is not _FSDP_GATHER
            and _kind(nd) != "attention"
        )

    def attention_again(self, tags: Tags, longer: bool = False) -> float:
        # (a recomputed ring attention's sends are not in ``Rung.comm``, which counts functional
        # collectives: ``_resent``)
        """The attention ops ``tags`` recompute (whole layers), read from the tags: SDPA carries
        torch's random tag, so the partitioner recomputes it inside its RNG-state wrapper, under
        another name in the backward."""
        return sum(
            self.cost_of(nd, longer)
            for nd in self.graph.graph.nodes
            if nd.op == "call_function" and tags.get(nd.name) in _RECOMPUTED and _kind(nd) == "attention"
        )


def _settled(policy, rung: Rung) -> bool:
    """Whether later rungs (recomputing more) cannot be the policy's choice."""
    if policy == "auto":
        return rung.weighed[1] > AUTO_OVERHEAD
    return isinstance(policy, int) and rung.memory.peak <= policy


# the longest length a budget's rung is searched to: beyond it, no bound
LONGEST = 1 << 26


def _length_symbol(fw: fx.GraphModule) -> tuple | None:
    """(symbol, hint) of the one symbol in the sizes of ``fw``'s inputs (a symbolic length), or
    None (static sizes, or several symbols: a data-dependent count's besides the length)."""
    symbols, shape_env = set(), None
    for nd in fw.graph.find_nodes(op="placeholder"):
        v = nd.meta.get("val")
        if isinstance(v, torch.Tensor):
            symbols |= free_symbols(v)
            shape_env = shape_env or next((d.node.shape_env for d in v.shape if isinstance(d, torch.SymInt)), None)
    if len(symbols) != 1 or shape_env is None:
        return None
    (symbol,) = symbols
    value = shape_env.backed_var_to_val.get(symbol)
    return None if value is None else (symbol, int(value))


def _fit_limit(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, budget: int, symbol, start: int) -> int:
    """The longest length (from ``start`` up, or down to 2) at which this rank's predicted peak
    of the rung partitioned as (``fw``, ``bw``) fits ``budget``: 1 if none does, ``LONGEST`` if
    every one does up to it. The peak grows with the length (sizes are linear in it, but for
    a chunk pad's steps), so the search halves an interval."""

    def fits(length: int) -> bool:
        return estimate_memory(fw, bw, num_fwd_outputs, at_length(symbol, length)).peak <= budget

    lo, hi = (start, 2 * start) if fits(start) else (1, start)
    while lo == hi // 2 and fits(hi):  # doubling while it fits
        if hi >= LONGEST:
            return LONGEST
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _budget_lengths(results, rung: Rung, budget: int, num_fwd_outputs: int, smallest) -> tuple | None:
    """A budget's rung on a symbolic length: (symbol, lo, hi), the lengths at which it is the
    rung the budget takes on every rank (its peak fits up to hi on the rank that needs most; no
    rung before it fits from lo on), or None (no single length symbol, or
    peaks that do not grow with it). ``smallest``: per rung, the least over the sp ranks (an
    exchange every rank makes; an empty list where this rank has no bound to offer). Only the
    rung taken and those before it are read (a budget takes the first that fits); where one of
    them has a size with another symbol (a recomputed SDPA's RNG state), the rung is guarded to
    the first length alone."""
    found = _length_symbol(results[0][1])
    i = next(j for j, (r, _, _) in enumerate(results) if r is rung)
    limits, unread = [], False
    if found is not None:
        symbol, start = found
        try:
            limits = [_fit_limit(fw, bw, num_fwd_outputs, budget, symbol, start) for _, fw, bw in results[: i + 1]]
        except _UNREAD:  # the graphs' inputs have one symbol only; a size may have another
            limits, unread = [], True  # every rank still exchanges
    limits = smallest(limits)
    if found is None:
        return None
    if unread:
        return symbol, start, start
    if not limits:
        return None
    lo = max(limits[:i]) + 1 if i else None  # the rungs before it: preferred where they fit
    hi = limits[i] if limits[i] < LONGEST else None
    if (lo is not None and lo > start) or (hi is not None and hi < start):
        return None
    return symbol, lo, hi


def _drop_dead_collectives(gm: fx.GraphModule) -> None:
    """Remove collectives whose result nothing reads. The partitioner can carry the loss's
    all-reduce into the backward with the recomputed loss ops (a wait is never dead code to fx),
    and on some ranks only: its choice depends on the local sizes, and ranks that issue different
    collectives hang. Until none is left: dropping the loss's all-reduce leaves the recomputed
    ops before it dead, and with them a collective they read (a maximum's all-reduce, and the
    matmul before it)."""
    changed = False
    while dead := [
        nd for nd in gm.graph.nodes if nd.target is torch.ops._c10d_functional.wait_tensor.default and not nd.users
    ]:
        for nd in dead:
            gm.graph.erase_node(nd)
        gm.graph.eliminate_dead_code()
        changed = True
    if changed:
        gm.recompile()


@dataclass(frozen=True)
class _Partitioner:
    """AOTAutograd's min-cut partitioner on a tagged copy of a graph, and the rung it makes: the
    memory it predicts and what its backward recomputes, against the step's cost (that of the
    untiled ``base`` ladder), at the graph's sizes and, where ``base`` has one, at the longer
    length "auto" weighs rungs at."""

    joint_inputs: object
    num_fwd_outputs: int
    kwargs: dict
    base: _Ladder
    # (ladder, tags) -> the partitioner's (forward, backward): an offloaded twin starts from a
    # copy of its base rung's, not from another min-cut
    partitioned: dict = dataclasses.field(default_factory=dict)
    copied: float = MACHINE_BALANCE  # ``Balance.copied``

    def _partition(self, ladder: _Ladder, tags: Tags):
        key = (id(ladder), id(tags))
        if key not in self.partitioned:
            g = _tagged_copy(ladder.graph, tags, ladder.regions)
            fw, bw = partitioners.min_cut_rematerialization_partition(
                g, self.joint_inputs, num_fwd_outputs=self.num_fwd_outputs, **self.kwargs
            )
            _drop_dead_collectives(bw)
            self.partitioned[key] = fw, bw
        return self.partitioned[key]

    def __call__(self, ladder: _Ladder, spec: RungSpec, tags: Tags):
        """(Rung, forward, backward); on a tiled ``ladder``, the tiles' joins and partial sums
        count as recompute (views, the tiles' slices, write nothing); an offloaded rung's copies
        to the host and back count as their bytes twice over the host link (``Balance.copied``)."""
        fw, bw = self._partition(ladder, tags)
        if spec.offload:  # torch's pass rewrites the graphs in place: on copies of the base rung's
            fw, bw = _graph_copy(fw)[0], _graph_copy(bw)[0]
            offload_saved(fw, bw, self.num_fwd_outputs, ladder.layers)
        memory = estimate_memory(fw, bw, self.num_fwd_outputs)

        def recompute(longer: bool = False, host: int = memory.host) -> float:
            extra = max(ladder.written(longer) - self.base.written(longer), 0.0) if ladder is not self.base else 0.0
            return ladder.recompute_cost(fw, bw, tags, longer) + extra + 2 * host * self.copied

        step, attention = self.base.total()
        longer = None
        if ladder.longer is not None and self.base.longer is not None:
            length, read, _ = ladder.longer
            try:
                there = estimate_memory(fw, bw, self.num_fwd_outputs, read)
                longer = (length, there.peak, recompute(True, there.host) / max(self.base.total(True)[0], 1.0))
            except _UNREAD:
                longer = None
        flops, written = self.base.work
        rung = Rung(
            spec,
            memory,
            recompute(),
            step,
            attention,
            longer,
            flops=flops,
            written=written,
            comm=_resent(fw, bw),
            recompute_attention=ladder.attention_again(tags),
            copied=self.copied,
        )
        return rung, fw, bw


_RECOMPUTED = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
# bytes a rank sends for a functional collective, per byte of its (local) input, in a group of n
# (the ring model of ``propagate._placement.transfer_bytes``, on local sizes)
_SENT = {
    "all_to_all_single": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: n - 1,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
}


def _resent(fw: fx.GraphModule, bw: fx.GraphModule) -> float:
    """Bytes per rank the backward's recomputed functional collectives send (whole layers; a
    recomputed ring attention op's own sends are not counted)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    done = {nd.name for nd in fw.graph.nodes if nd.op == "call_function"}
    total = 0.0
    for nd in bw.graph.nodes:
        name = getattr(getattr(nd.target, "overloadpacket", None), "__name__", None)
        if nd.op == "call_function" and nd.name in done and name in _SENT:
            args = op_args(nd)
            n = _resolve_process_group(args["group_name"]).size()
            total += _SENT[name](n) * _nbytes(args["input"].meta.get("val"))
    return total


class _Unpriced(Exception):
    """The rungs cannot be priced from the first rung's graphs."""


@dataclass(frozen=True)
class _Priced:
    """The untiled rungs priced from the partition of the first ("none"), not partitioned each
    (one min-cut on the whole graph a rung: 3-4 s at 32 layers). A rung recomputes what its tags
    say on top of what the first rung recomputes (the partitioner never saves an op tagged to
    recompute): each value the first rung saves that the rung tags is recomputed from its inputs,
    back to values the rung does not tag (saved in its place) or the step's inputs. Its memory is
    the same liveness walk as a partitioned rung's (``estimate_memory``), over the first rung's
    forward keeping those values and its backward with the recomputed ops before their first use,
    as the partitioner places them; its recompute is the first rung's and those ops'. What the
    partitioner might decide besides (recomputing an untagged op) is not seen: the rung "auto"
    takes is partitioned and checked (``_partitioned``)."""

    ladder: _Ladder
    base: Rung
    fw: fx.GraphModule
    bw: fx.GraphModule
    num_fwd_outputs: int

    @functools.cached_property
    def _first(self) -> dict:
        """The first rung's graphs as joint-graph nodes, the same for every rung priced: its
        forward's nodes in order, the backward's inputs and ops, what it recomputes, the step's
        outputs and the gradients."""
        joint = {nd.name: nd for nd in self.ladder.graph.graph.nodes}
        alien = [nd.name for g in (self.fw, self.bw) for nd in g.graph.nodes if nd.op != "output"]
        alien = [name for name in alien if name not in joint]
        if alien:
            raise _Unpriced(f"the partitioner's graphs have nodes the joint graph has not ({', '.join(alien[:3])})")
        fw_nodes = [joint[nd.name] for nd in self.fw.graph.nodes if nd.op != "output"]
        fw_ops = {nd for nd in fw_nodes if nd.op == "call_function"}
        bw_ops = [joint[nd.name] for nd in self.bw.graph.nodes if nd.op == "call_function"]
        outs = tree_leaves(self.fw.graph.output_node().args)[: self.num_fwd_outputs]
        return dict(
            fw_nodes=fw_nodes,
            bw_inputs=[joint[nd.name] for nd in self.bw.graph.find_nodes(op="placeholder")],
            bw_ops=bw_ops,
            recomputed=frozenset(nd for nd in bw_ops if nd in fw_ops),
            user_out=[joint[x.name] for x in outs if isinstance(x, fx.Node)],
            grads={joint[x.name] for x in tree_leaves(self.bw.graph.output_node().args) if isinstance(x, fx.Node)},
            step_inputs={nd for nd in fw_nodes if nd.op == "placeholder"},
        )

    def _schedule(self, tags: Tags):
        """(saved, recomputed, backward, backward inputs) under ``tags``, as joint-graph nodes: the
        backward's nodes in the order they run."""
        first = self._first
        recomputed = set(first["recomputed"])
        regions = self.ladder.regions

        def recomputes(nd: fx.Node) -> bool:
            # as the partitioner reads the tags (``cleanup_recompute_tags``): an op whose result a
            # later region recomputes from is saved, at the boundary between the two
            return tags.get(nd.name) in _RECOMPUTED and not any(
                tags.get(u.name) in _RECOMPUTED and regions.get(u.name, -1) > regions.get(nd.name, -1)
                for u in nd.users
                if nd.name in regions and u.name in regions
            )

        saved: dict[fx.Node, None] = {}  # in the order found
        todo = [nd for nd in first["bw_inputs"] if nd.op != "placeholder"]
        while todo:
            nd = todo.pop()
            if nd in recomputed or nd in saved:
                continue
            if nd.op != "placeholder" and recomputes(nd):
                recomputed.add(nd)
                todo.extend(nd.all_input_nodes)
            else:
                saved[nd] = None
        # the backward: its inputs (the step's that it reads, the tangents, the values saved), then
        # its ops, each recomputed value just before its first use
        inputs = list(dict.fromkeys([*(nd for nd in first["bw_inputs"] if nd.op == "placeholder"), *saved]))
        done, order = set(inputs), list(inputs)

        def need(nd: fx.Node) -> None:
            stack = [(nd, False)]
            while stack:
                x, ready = stack.pop()
                if x in done:
                    continue
                if ready:
                    done.add(x)
                    order.append(x)
                    continue
                stack.append((x, True))
                stack.extend((a, False) for a in reversed(x.all_input_nodes) if a not in done)

        for nd in first["bw_ops"]:
            need(nd)
        return list(saved), recomputed, order, inputs

    def __call__(self, spec: RungSpec, tags: Tags) -> Rung:
        saved, recomputed, bw_nodes, bw_inputs = self._schedule(tags)
        first = self._first
        fw_nodes, user_out, grads, step_inputs = (first[k] for k in ("fw_nodes", "user_out", "grads", "step_inputs"))
        ladder, base = self.ladder, self.base

        def memory(read: Callable = hint) -> MemoryEstimate:
            fw_peak, fw_end = sequence_peak(fw_nodes, dict.fromkeys(step_inputs, False), {*user_out, *saved}, read)
            fw_end -= sum(_nbytes(nd.meta.get("val"), read) for nd in user_out)
            counted = {nd: nd.op != "placeholder" or nd not in step_inputs for nd in bw_inputs}
            bw_peak, grads_live = sequence_peak(bw_nodes, counted, grads, read)
            return MemoryEstimate(base.memory.params, grads_live, fw_end, fw_peak, bw_peak)

        def recompute(longer: bool = False) -> float:
            return sum(ladder.cost_of(nd, longer) for nd in recomputed if nd.target is not _FSDP_GATHER)

        longer = None
        if base.longer is not None:
            length, read, _ = ladder.longer
            try:
                longer = (length, memory(read).peak, recompute(True) / max(ladder.total(True)[0], 1.0))
            except _UNREAD:
                longer = None
        return dataclasses.replace(base, spec=spec, memory=memory(), recompute=recompute(), longer=longer, priced=True)


def _auto(ladder: _Ladder, rungs, partition: _Partitioner):
    """The untiled rungs for "auto" from one partition: the first rung partitioned, the others
    priced from it (``_Priced``) up to where the climb would stop (the first rung past the
    overhead): ([(Rung, forward, backward)] as ``_climb`` makes them, the priced ones without
    graphs; settled). The rung the policy takes is partitioned afterwards (``_partitioned``)."""
    first = partition(ladder, *rungs[0])
    priced = _Priced(ladder, *first, partition.num_fwd_outputs)
    results, seen, settled = [first], [rungs[0][1]], _settled("auto", first[0])
    for spec, tags in rungs[1:]:
        if settled:
            break
        if tags in seen:
            continue
        seen.append(tags)
        results.append((priced(spec, tags), None, None))
        settled = _settled("auto", results[-1][0])
    return results, settled


def _evaluate(ladder: _Ladder, rungs, partition: _Partitioner, policy, every_rung: bool):
    """The untiled rungs weighed: (results, settled, priced). "auto" prices them from one
    partition (``_auto``; the rung it takes is partitioned afterwards), the other policies and
    ``every_rung`` partition each (``_climb``), as does "auto" where the first rung's graphs
    cannot price the others."""
    if policy == "auto" and not every_rung and len(rungs) > 1:
        try:
            return (*_auto(ladder, rungs, partition), True)
        except _Unpriced as e:
            log.info("autosp: checkpoint=auto: %s; partitioning each rung", e)
    return (*_climb(ladder, rungs, partition, policy, every_rung), False)


def _partitioned(results, rung: Rung, ladder: _Ladder, rungs, partition: _Partitioner):
    """``results`` with ``rung``'s graphs (partitioned where it was priced), and the rung as
    partitioned; None where it is past the overhead ``auto`` allows (its pricing missed recompute
    the partitioner added)."""
    i = next(j for j, r in enumerate(results) if r[0] is rung)
    if results[i][1] is not None:
        return results, rung
    tags = next(t for spec, t in rungs if spec == rung.spec)
    real, fw, bw = partition(ladder, rung.spec, tags)
    if real.weighed[1] > AUTO_OVERHEAD:
        return None
    return [*results[:i], (real, fw, bw), *results[i + 1 :]], real


def _climb(ladder: _Ladder, rungs, partition: _Partitioner, policy, every_rung: bool):
    """The rungs partitioned from the one that recomputes least, until the policy is settled
    (all of them with ``every_rung``): ([(Rung, forward, backward)], settled). A rung that tags
    what one before it does is skipped, but under a budget (compared rung by rung over the
    ranks), where it repeats that one's result."""
    results, seen, settled = [], [], False
    for spec, tags in rungs:
        if tags in seen:  # a rung that tags nothing more than one before it
            if isinstance(policy, int):
                rung, fw, bw = results[seen.index(tags)]
                results.append((dataclasses.replace(rung, spec=spec), fw, bw))
                seen.append(tags)
            continue
        seen.append(tags)
        results.append(partition(ladder, spec, tags))
        settled = _settled(policy, results[-1][0])
        if not every_rung and settled:
            break
    return results, settled


def _beyond(
    ladder: _Ladder, partition: _Partitioner, tiled, tiles: tuple[int, int], longer, every_rung: bool, offload: bool
):
    """The rungs past the untiled "full", partitioned, in the order a budget takes them: the tiled
    "full" ones, the offloaded twins of all "full" ones (``offload``), then (budgets and
    ``every_rung``: they send their collectives again) the "whole layers" ones, untiled and tiled,
    and their offloaded twins."""
    more = [(ladder, spec, tags) for spec, tags in ladder.rungs]
    if tiled is not None:
        tiled_ladder = _Ladder.of(tiled(), tiles, longer, ladder.balance)
        more += [(tiled_ladder, spec, tags) for spec, tags in tiled_ladder.rungs]
    full = [r for r in more if r[1].kind == "full"]
    layers = [r for r in more if r[1].kind == "layers"] if every_rung else []

    def twins(rungs: list) -> list:
        return [(lad, dataclasses.replace(spec, offload=True), tags) for lad, spec, tags in rungs] if offload else []

    todo = [r for r in full if r[0] is not ladder] + twins(full) + layers + twins(layers)
    return [partition(*r) for r in todo]


def checkpoint_partition(
    gm: fx.GraphModule,
    joint_inputs,
    policy,
    *,
    num_fwd_outputs: int,
    every_rung: bool = False,
    largest=None,
    smallest=None,
    tiled: Callable[[], fx.GraphModule] | None = None,
    tiles: tuple[int, int] = (1, 1),
    offload: bool = False,
    balance: Balance = Balance(),
    **kwargs,
):
    """Partition the per-rank joint graph under ``policy``: (forward, backward, Checkpoint). The
    ladder is walked from the rung that recomputes least and stops once the policy is settled,
    unless ``every_rung`` (planning tools compare them all). A budget evaluates every rung and
    holds each against ``largest(peaks)``, the peaks of the rank that needs most: ranks with
    uneven shards (or K/V-gathered attention, whose first rank runs one block fewer) predict
    different peaks, and every rank must take the same decision, or raise the same error.
    ``tiled``: makes the same graph tiled along the sequence (``_tiling``; ``tiles``: its groups'
    fewest and most tiles); its "full"
    and "full + loss" rungs follow the ladder, evaluated when the policy may want less memory than
    the untiled "full" gives, then (budgets and ``every_rung``) the "whole layers" rungs, untiled
    and tiled. ``smallest``, on a symbolic length: per rung, the least of a value
    over the ranks; with it, a budget's decision says the lengths it holds for
    (``Checkpoint.lengths``, ``_budget_lengths``). ``offload``: each rung that recomputes every
    layer op also has a twin whose saved layer activations are in host memory (``_offload``),
    weighed after it. ``balance``: how a byte weighs against a flop (a device's, ``Balance.of``)."""
    check_policy(policy)
    every_rung = every_rung or isinstance(policy, int)
    longer = None
    found = _length_symbol(gm) if policy in ("auto", "full") else None
    if found is not None:  # a symbolic length: one rung for every length, weighed at a longer one
        symbol, start = found
        longer = (AUTO_LONGER * start, at_length(symbol, AUTO_LONGER * start))
    ladder = _Ladder.of(gm, longer=longer, balance=balance.written)
    partition = _Partitioner(joint_inputs, num_fwd_outputs, kwargs, ladder, copied=balance.copied)
    rungs = [(spec, tags) for spec, tags in ladder.rungs if spec.kind != "layers"]
    if policy in ("none", "full") and not every_rung:
        rungs = rungs[:1] if policy == "none" else rungs[-1:]
    results, settled, pricing = _evaluate(ladder, rungs, partition, policy, every_rung)
    # the tiled and offloaded rungs: where the walk reached "full" (a budget or a planning tool:
    # always, and a budget alike on every rank)
    weighs_tiles = policy != "none" and rungs[-1][0].kind == "full" and (every_rung or not settled)
    beyond = _beyond(ladder, partition, tiled, tiles, longer, every_rung, offload) if weighs_tiles else []
    results += beyond
    evaluated = [r for r, _, _ in results]
    peaks = [r.memory.peak for r in evaluated]
    if largest is not None and isinstance(policy, int):
        peaks = largest(peaks)
    rung = select(policy, evaluated, peaks)
    if pricing:
        checked = _partitioned(results, rung, ladder, rungs, partition)
        if checked is None:  # the priced choice is past the overhead, partitioned: climb as without pricing
            log.info("autosp: checkpoint=auto: rung %r priced under the overhead is over it; climbing", rung.name)
            results, settled = _climb(ladder, rungs, partition, policy, every_rung)
            results += beyond
            evaluated = [r for r, _, _ in results]
            rung = select(policy, evaluated, [r.memory.peak for r in evaluated])
        else:
            results, rung = checked
            evaluated = [r for r, _, _ in results]
    _, fw, bw = next(r for r in results if r[0] is rung)
    lengths = None
    if smallest is not None and isinstance(policy, int):
        lengths = _budget_lengths(results, rung, policy, num_fwd_outputs, smallest)
    name = f"{policy} bytes" if isinstance(policy, int) else policy
    note = ""
    if policy != "none" and len(ladder.rungs) == 1:
        note = (
            "no repeated blocks found (two or more modules of one class held by one module, or a container's "
            "items), so no rung recomputes anything; checkpointing applies to layers run as such modules"
        )
        log.warning("autosp: checkpoint=%s: %s", name, note)
    return fw, bw, Checkpoint(name, rung, tuple(evaluated), weighs_tiles, lengths, note)
