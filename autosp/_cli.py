"""``autosp plan``: per-rank memory and communication of a model's training step at real sizes,
and the longest sequence that fits, planned on this machine without the hardware.

    autosp plan --model llama-3.1-8b --sp 8 --memory 80GiB --dtype bf16 --optimizer adamw --seq 65536

The model is built from its config (a preset name or an HF ``config.json``) with uninitialised
weights, traced on fake tensors with a fake process group of ``sp`` ranks, and planned by the
same pipeline as a real run (``autosp.explain``); nothing runs. Layers are identical, so the
memory and the recompute cost of a step are affine in the layer count: the plan is traced with
one and with two layers and extrapolated to the model's depth (checked against a full-depth
trace in the tests). Memory per rank = parameters + gradients + optimizer state + the step's
activations and temporaries (``checkpoint`` none / auto / full); the maximum sequence length is
found by bisection on those functions of the sequence length, then confirmed by a trace at the
answer and bisected again from there (see ``PlanFit``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import _devices
from ._attention_ops import GPU_KERNELS
from ._context import ATTENTION_CHOICES
from ._devices import DEVICES, device

__all__ = ["main", "PRESETS", "PlanFit", "trace_plan", "max_sequence"]

# public config.json fields of the models the AutoSP paper reports (no hub access needed)
_LLAMA = dict(
    model_type="llama",
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
)
PRESETS = {
    "llama-3.1-8b": dict(
        _LLAMA,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "llama-3.2-3b": dict(
        _LLAMA,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        _LLAMA,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# optimizer state per parameter: (times the parameter's bytes, plus fixed bytes). AdamW keeps
# exp_avg and exp_avg_sq in the parameters' dtype; "adamw-mixed" is mixed precision as DeepSpeed
# and Megatron run it: an fp32 master copy and fp32 moments (12 bytes per parameter)
_OPTIMIZER_STATE = {"adamw": (2, 0), "adamw-mixed": (0, 12), "sgd": (0, 0), "sgd-momentum": (1, 0)}
# "budget": the first rung of the ladder that fits the memory, as shard(checkpoint=<bytes>) takes it
_POLICIES = ("none", "auto", "full", "budget")
_FSDP = ("none", "sp", "dp", "world", "hsdp")


def parse_bytes(text: str) -> int:
    """'80GiB' (powers of 2), '24GB' (powers of 10) or a byte count."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(?:([KMGT])(i?)B?|B)?\s*", text, re.IGNORECASE)
    value = (
        int(
            float(m.group(1))
            * ((1024 if m.group(3) else 1000) ** ("KMGT".index(m.group(2).upper()) + 1) if m.group(2) else 1)
        )
        if m
        else 0
    )
    if value <= 0:
        raise argparse.ArgumentTypeError(f"autosp: memory {text!r}; write a positive size, e.g. 80GiB, 24GB or 1000000")
    return value


def load_model_config(name: str) -> dict:
    if name.lower() in PRESETS:
        return dict(PRESETS[name.lower()])
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SystemExit(
            f"autosp plan: no preset or config file {name!r}; presets: {', '.join(PRESETS)}, or pass an HF "
            "config.json (or a directory holding one)"
        )
    return json.loads(path.read_text())


@dataclass(frozen=True, slots=True)
class Traced:
    """One policy's plan at one sequence length, at the model's depth."""

    policy: str
    rung: str
    activations: int  # step peak beyond parameters and optimizer state (gradients included)
    comm_bytes: float
    collectives: int
    recompute: float  # fraction of the step's estimated cost
    grads: int = 0  # the gradients' bytes in ``activations`` (held whole on every rank)
    forward_peak: int = 0
    backward_peak: int = 0
    flops: float = 0.0  # the step's matmul and attention flops per rank, without recomputation
    written: float = 0.0  # the bytes its ops write per rank
    host: int = 0  # saved activations in host memory (an offloaded rung), not in ``activations``
    copies: float = 0.0  # the part of ``recompute`` that is their copies out and back

    def step_time(self, dev, ranks: int) -> float:
        """The device's roofline time for this step (``Device.step_time``): the copies over the
        host link, the rest of the overhead as recomputation."""
        overhead = self.recompute - self.copies
        return dev.step_time(self.flops, self.written, self.comm_bytes, ranks, overhead, 2 * self.host)


def _build_meta(cfg: dict, dtype: torch.dtype, layers: int | None = None):
    import transformers as T

    fields = {**cfg, **({"num_hidden_layers": layers} if layers else {})}
    config = T.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)


def trace_plan(
    cfg: dict,
    *,
    layers: int,
    seq: int,
    batch: int,
    sp: int,
    dtype: torch.dtype,
    policy: str = "auto",
    attention: str = "auto",
    ulysses: int | None = None,
    offload: bool = False,
    device: str | None = None,
    attention_kernel: str | None = None,
):
    """``autosp.explain`` of one training step of the model cut to ``layers`` layers, with every
    rung of the checkpointing ladder evaluated (with ``offload``, the offloaded ones too); with a
    ``device``, attention as the kernel SDPA runs there (``explain(device=...)``)."""
    import autosp

    # uninitialised CPU storage: tracing reads shapes only, so the pages are never touched
    model = _build_meta(cfg, dtype, layers).to_empty(device="cpu").train()
    ids = torch.zeros(batch, seq, dtype=torch.long)
    step = autosp.shard(
        lambda input_ids, labels: model(input_ids=input_ids, labels=labels).loss,
        compiler="aot_eager",
        checkpoint=policy,
        every_rung=True,
        attention=attention,
        offload=offload,
        dynamic=False,  # a plan at this length exactly (its fit extrapolates in the length)
        device=device,
    )
    # attention as the GPU's kernel where autosp has its records (NVIDIA's); the device's figures
    # weigh the checkpointing costs on any device
    gpu = device if device is not None and _devices.device(device).vendor == "nvidia" else None
    with autosp.mesh(sp=sp, ulysses=ulysses):
        return autosp.explain(step, ids, ids, device=gpu, attention_kernel=attention_kernel)


class PlanFit:
    """Plans traced at (2 and 3 layers) x (two lengths), as functions of the sequence length at
    the model's depth. Per rung, the saved and gradient bytes and the non-attention costs are
    affine in the layer count past the first layers (a layer between the first and the last is
    like any other: the last runs in the tiles of the logits' group, ``_tiling._caps``, so one
    layer against two would price the first layer's tiles as every layer's difference), and the
    peaks grow per layer by the most the saved or the gradient bytes grow (``_rung``); within a
    regime, they are affine in the sequence length: every tensor of the step is proportional to
    the tokens per rank (attention runs as a fused kernel without score matrices), but the peak
    is the largest of the step's moments, so where another moment takes over the line bends
    upward. ``refine`` traces at a length and fits from the nearest traced one, so answers are
    confirmed by a trace at (or next to) their own length. Attention's cost is quadratic in the
    length."""

    LAYERS = (2, 3)

    def __init__(
        self,
        cfg: dict,
        *,
        sp: int,
        seqs: tuple[int, int],
        batch: int,
        dtype: torch.dtype,
        attention: str = "auto",
        ulysses: int | None = None,
        offload: bool = False,
        device: str | None = None,
        attention_kernel: str | None = None,
    ):
        self.cfg, self.sp, self.batch, self.dtype, self.attention = cfg, sp, batch, dtype, attention
        self.ulysses, self.offload = ulysses, offload
        self.device, self.attention_kernel = device, attention_kernel
        self.layers, self.seqs = cfg["num_hidden_layers"], seqs
        self.plans: dict = {}
        for s in seqs:
            self._trace(s)

    def _trace(self, seq: int) -> None:
        for k in self.LAYERS:
            if (k, seq) not in self.plans:
                self.plans[(k, seq)] = trace_plan(
                    self.cfg,
                    layers=k,
                    seq=seq,
                    batch=self.batch,
                    sp=self.sp,
                    dtype=self.dtype,
                    attention=self.attention,
                    ulysses=self.ulysses,
                    offload=self.offload,
                    device=self.device,
                    attention_kernel=self.attention_kernel,
                )

    def refine(self, seq: int) -> None:
        """Trace at ``seq`` and fit from it and the nearest other traced length."""
        self._trace(seq)
        others = sorted({s for _, s in self.plans if s != seq}, key=lambda s: abs(s - seq))
        self.seqs = (seq, others[0])

    def _value(self, get, seq: int, quadratic: bool = False, slope=None) -> float:
        """``get`` of a plan at the model's depth and ``seq`` tokens: per traced length, from the
        deeper trace by the layers' slope (``slope(shallower, deeper)``: its growth per layer;
        by default the two traces' difference), then linear (or quadratic) in the length."""
        (s1, s2), L, (k1, k2) = self.seqs, self.layers, self.LAYERS

        def at(s: int) -> float:
            a, b = self.plans[(k1, s)], self.plans[(k2, s)]
            per = (get(b) - get(a) if slope is None else slope(a, b)) / (k2 - k1)
            return get(b) + per * (L - k2)

        if quadratic:
            return at(s1) * (seq / s1) ** 2
        return at(s1) + (at(s2) - at(s1)) * (seq - s1) / (s2 - s1)

    def rungs(self, seq: int):
        # rungs are matched by what they recompute; the tiled rung's tile count follows the length
        # (a trace too short to tile has no such rung: the fit then goes without it)
        traces = [self.plans[(k, s)] for k in self.LAYERS for s in self.seqs]
        common = [r.spec.key for r in traces[0].checkpoint.rungs]
        for p in traces[1:]:
            common = [k for k in common if k in {r.spec.key for r in p.checkpoint.rungs}]
        return [self._rung(key, seq) for key in common]

    def _rung(self, key: tuple, seq: int):
        """The rung ``key`` (``RungSpec.key``) at the model's depth and ``seq`` tokens."""
        from .partition import MemoryEstimate, Rung

        def rung(plan):
            return next(r for r in plan.checkpoint.rungs if r.spec.key == key)

        def value(get, quadratic: bool = False, slope=None) -> float:
            return self._value(lambda plan: get(rung(plan)), seq, quadratic, slope)

        def grown(*fields: str):
            """A peak's growth per layer: the most that any of ``fields`` grows by (a peak is the
            largest of the step's moments, each holding some layers' saved activations and the
            others' gradients, so the two traces' peaks differ by whichever moment peaked there:
            measured on Llama-3.1-8B, 2 and 3 layers' peaks extrapolated to 8 were 28% under an
            8-layer trace on one rung, the saved and gradient bytes' growth within 6% on every rung)."""
            return lambda a, b: max(getattr(rung(b).memory, f) - getattr(rung(a).memory, f) for f in fields)

        params, grads, saved, host = (
            int(value(lambda r, f=f: getattr(r.memory, f))) for f in ("params", "grads", "saved", "host")
        )
        fw = int(value(lambda r: r.memory.forward_peak, slope=grown("saved")))
        bw = int(value(lambda r: r.memory.backward_peak, slope=grown("saved", "grads")))
        # with more layers the backward's peak can move from the loss to its end, where every
        # gradient is held next to the saved activations: both are sums over the layers
        mem = MemoryEstimate(params, grads, saved, fw, max(bw, saved + grads), host)
        attention = value(lambda r: r.attention, quadratic=True)
        step = value(lambda r: r.step - r.attention) + attention
        flops = value(lambda r: r.flops - r.attention) + attention
        spec = rung(self.plans[(self.LAYERS[0], self.seqs[0])]).spec
        written = value(lambda r: r.written)
        comm = value(lambda r: r.comm)
        # recomputed attention (whole layers) is quadratic in the length, the rest linear
        again = value(lambda r: r.recompute_attention, quadratic=True)
        recompute = value(lambda r: r.recompute - r.recompute_attention) + again
        return Rung(
            spec, mem, recompute, step, attention, flops=flops, written=written, comm=comm, recompute_attention=again
        )

    def at(self, seq: int, policy: str, fits: Callable[[Traced], bool] | None = None) -> Traced:
        """The figures of the rung ``policy`` takes at ``seq`` tokens; "budget": the first rung of
        the ladder that ``fits`` (as ``shard(checkpoint=<bytes>)`` takes it), else the one with
        the least memory."""
        from .partition._checkpoint import select

        rungs = self.rungs(seq)
        if policy == "budget":
            traced = [self._traced(policy, rung, seq) for rung in rungs]
            return next((t for t in traced if fits is not None and fits(t)), min(traced, key=lambda t: t.activations))
        return self._traced(policy, select(policy, rungs), seq)

    def _traced(self, policy: str, rung, seq: int) -> Traced:
        m = rung.memory
        return Traced(
            policy,
            rung.name,
            m.peak,
            self._value(lambda p: p.comm_bytes, seq) + rung.comm,
            round(self._value(lambda p: len(p.collectives), seq)),
            rung.overhead,
            m.grads,
            m.forward_peak,
            m.backward_peak,
            rung.flops,
            rung.written,
            m.host,
            rung.copies,
        )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a rank's parameters, gradients and optimizer state live: whole on every rank, or
    sharded over ``shards`` ranks as FSDP2 shards them (``fully_shard``), on the device or, with
    ``offload``, on the host (FSDP2's ``CPUOffloadPolicy``: parameters, gradients and optimizer
    state in host memory, each layer's parameters copied in and gathered for its forward and
    backward). ``layer``: the largest layer's parameter bytes, which a sharded rank gathers."""

    params: int  # bytes, whole
    optimizer: int  # bytes, whole
    layer: int
    shards: int = 1
    offload: bool = False

    @property
    def device(self) -> int:
        """Parameter and optimizer bytes per rank on the device (the step's own beyond them)."""
        return 0 if self.offload else (self.params + self.optimizer) // self.shards

    @property
    def host(self) -> int:
        """Parameter, gradient and optimizer bytes per rank in host memory (with offload)."""
        return (2 * self.params + self.optimizer) // self.shards if self.offload else 0

    def activations(self, t: Traced) -> int:
        """The step's peak beyond parameters and optimizer state (``Traced.activations``, traced
        with the whole model on every rank), with FSDP2's: gradients reduce-scattered to a shard
        (on the host with offload) as each layer's backward ends, and the gathered layers'
        transient: the one running and the next, prefetched, and the running one's unsharded
        gradient (three layers' parameter bytes)."""
        if self.shards == 1 and not self.offload:
            return t.activations
        kept = 0 if self.offload else t.grads // self.shards
        return max(t.forward_peak, t.backward_peak - t.grads + kept) + 3 * self.layer


def _placement(cfg: dict, dtype: torch.dtype, optimizer: str, shards: int = 1, offload: bool = False) -> Placement:
    """Parameter and optimizer bytes of the model (whole), its largest layer's, and how they are
    placed per rank."""
    model = _build_meta(cfg, dtype)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    times, fixed = _OPTIMIZER_STATE[optimizer]
    optimizer_bytes = times * params + fixed * sum(p.numel() for p in model.parameters())
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    layer = max((sum(p.numel() * p.element_size() for p in b.parameters()) for ml in layers for b in ml), default=0)
    return Placement(params, optimizer_bytes, layer, shards, offload)


def max_sequence(
    fit: PlanFit,
    policy: str,
    *,
    budget: int,
    static: int,
    granule: int,
    hi: int = 2**25,
    activations: Callable[[Traced], int] = lambda t: t.activations,
    host: int | None = None,
    host_static: int = 0,
) -> tuple[int, Traced | None]:
    """The longest multiple of ``granule`` whose step fits ``budget`` bytes per rank, by bisection:
    ``static`` bytes beside the step's ``activations`` (those it traced, by default), and where
    ``host`` is given, ``host_static`` bytes beside its offloaded activations in that many bytes
    of host memory per rank. Where the policy's choice changes with the length ("auto": at longer
    lengths attention's quadratic share makes recomputation a smaller part of the step, and a rung
    that keeps less comes within the overhead), a longer length can fit past one that does not:
    lengths doubling past the answer are tried, and the search goes on from one that fits."""

    def fitting(t: Traced) -> bool:
        return static + activations(t) <= budget and (host is None or host_static + t.host <= host)

    def fits(seq: int) -> Traced | None:
        t = fit.at(seq, policy, fitting)
        return t if fitting(t) else None

    def between(lo: int, high: int) -> int:
        """Bisection between a length that fits (``lo``, or 0) and one that does not."""
        while high - lo > granule:
            mid = (lo + high) // 2 // granule * granule
            if mid <= lo:
                break
            lo, high = (mid, high) if fits(mid) is not None else (lo, mid)
        return lo

    def search(seq: int) -> int:
        """The longest fitting length, by steps doubling away from ``seq`` (up while it fits, down
        while it does not), then bisection: the fit is local to where it was last traced."""
        step = granule
        if fits(seq) is not None:
            while seq + step < hi and fits(seq + step) is not None:
                seq, step = seq + step, step * 2
            return between(seq, min(seq + step, hi))
        while seq - step > 0 and fits(seq - step) is None:
            seq, step = seq - step, step * 2
        return between(max(seq - step, 0), seq)

    def longest(seq: int) -> int:
        seq = search(seq)
        probe = 2 * max(seq, granule)
        while probe < hi:
            if fits(probe) is not None:
                seq = search(probe)
                probe = 2 * seq
            else:
                probe *= 2
        return seq

    seq = longest(max(granule, fit.seqs[0] // granule * granule))  # from where the fit was traced
    if seq:  # confirm with a trace at the answer, and search again from there
        fit.refine(seq)
        seq = longest(seq)
    return seq, (fits(seq) if seq else None)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="autosp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan", help="memory and communication per rank at real sizes, and the longest sequence that fits"
    )
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or an HF config.json")
    p.add_argument("--sp", type=int, required=True)
    p.add_argument(
        "--memory",
        type=parse_bytes,
        default=None,
        help="memory per device, e.g. 80GiB: also find the longest sequence that fits",
    )
    p.add_argument("--seq", type=int, default=None, help="sequence length (global) to report")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--optimizer", default="adamw", choices=sorted(_OPTIMIZER_STATE))
    p.add_argument(
        "--checkpoint",
        default=",".join(_POLICIES),
        help="comma-separated: none, auto, full, budget (the first rung that fits, as checkpoint=<bytes> takes it)",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=list(ATTENTION_CHOICES),
        help="attention kernel: chosen by cost (auto) or forced",
    )
    p.add_argument(
        "--ulysses",
        type=int,
        default=None,
        help="a 2D sp mesh: sub-groups of this many ranks (hybrid attention: Ulysses within, ring across)",
    )
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the sp group (world = dp x sp)")
    p.add_argument(
        "--fsdp",
        default="none",
        choices=_FSDP,
        help="parameters, gradients and optimizer state sharded as FSDP2 shards them: over the sp ranks, the dp "
        "replicas, the world, or hsdp (within a node, replicated across nodes)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="plan FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state in host memory",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="weigh checkpointing rungs whose saved layer activations are in host memory (shard(offload=True))",
    )
    p.add_argument(
        "--host-memory",
        type=parse_bytes,
        default=None,
        help="host memory per node, e.g. 2TiB: a length fits only where the node's ranks' host bytes fit it too "
        "(a check of the plan's: shard's budget holds device memory only)",
    )
    p.add_argument(
        "--device",
        default=None,
        help=f"the accelerator ({', '.join(DEVICES)}): its memory is --memory's default, the step time is "
        "its roofline's, and attention is planned as the kernel SDPA runs there (flash for bf16 without a mask)",
    )
    p.add_argument(
        "--attention-kernel",
        default=None,
        choices=sorted(GPU_KERNELS),
        help="plan attention as this GPU kernel, as torch.nn.attention.sdpa_kernel forces one",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (the auto policy's, or the first given)")
    return ap


def _shards(fsdp: str, sp: int, dp: int, per_node: int) -> int:
    """The ranks FSDP2 shards over under ``--fsdp``."""
    return {"none": 1, "sp": sp, "dp": dp, "world": sp * dp, "hsdp": min(sp * dp, per_node)}[fsdp]


def _summary(args, dev, memory, placed: Placement, policy: str, seq, t: Traced | None, attention: str, seconds):
    """``autosp plan --json``'s object: one policy's figures at ``--seq`` (else at the longest
    length that fits)."""
    took = None if t is None or dev is None else t.step_time(dev, args.sp)
    return {
        "model": args.model,
        "sp": args.sp,
        "dp": args.dp,
        "device": dev.name if dev else None,
        "memory_bytes": memory,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "fsdp": args.fsdp,
        "fsdp_shards": placed.shards,
        "cpu_offload": placed.offload,
        "checkpoint": policy,
        "longest_sequence": seq,
        "seq": args.seq or seq,
        "per_rank_device_bytes": None if t is None else placed.device + placed.activations(t),
        "per_rank_host_bytes": placed.host + (0 if t is None else t.host),
        "rung": None if t is None else t.rung,
        "recompute": None if t is None else t.recompute,
        "attention": attention,
        "offload": args.offload,
        # saved activations in host memory per rank (``per_rank_host_bytes`` adds the state's)
        "offloaded_bytes": None if t is None else t.host,
        "comm_bytes_per_step": None if t is None else t.comm_bytes,
        "predicted_step_time_s": took,
        "planning_seconds": seconds,
    }


def _host_text(placed: Placement, t: Traced) -> str:
    if not t.host and not placed.host:
        return ""
    return f", host {(placed.host + t.host) / 2**30:.2f} GiB (activations {t.host / 2**30:.2f})"


def _longest(
    fit: PlanFit, policies, memory: int, placed: Placement, granule: int, sp: int, say, time_text, host=None
) -> dict:
    """Per policy, the longest sequence that fits ``memory`` per device (and ``host`` bytes of
    host memory per rank) and its figures there (``max_sequence``), each said as a line."""
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    also = f" and {gib(host)} of host memory per rank" if host is not None else ""
    say(f"longest sequence that fits {gib(memory)} per device{also} (bisection, multiples of {granule}):")
    out = {}
    for policy in policies:
        seq, t = out[policy] = max_sequence(
            fit,
            policy,
            budget=memory,
            static=placed.device,
            granule=granule,
            activations=placed.activations,
            host=host,
            host_static=placed.host,
        )
        if t is None and placed.device >= memory:
            say(f"  checkpoint={policy:6s} none: parameters and optimizer state alone need {gib(placed.device)}")
        elif t is None:
            need = placed.device + placed.activations(fit.at(granule, policy))
            say(f"  checkpoint={policy:6s} none: {granule} tokens already need {gib(need)}")
        else:
            say(
                f"  checkpoint={policy:6s} {seq} tokens ({seq // sp} per rank), peak "
                f"{gib(placed.device + placed.activations(t))}{_host_text(placed, t)}, recompute "
                f"+{t.recompute:.1%} ({t.rung}){time_text(t)}"
            )
    return out


def _at_seq(fit: PlanFit, policies, args, placed: Placement, fitting, say, time_text) -> dict[str, Traced]:
    """Per policy, its figures at ``--seq``, each said as a line."""
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    fit.refine(args.seq)
    say(f"at {args.seq} tokens ({args.seq // args.sp} per rank):")
    out = {}
    for policy in policies:
        t = out[policy] = fit.at(args.seq, policy, fitting)
        say(
            f"  checkpoint={policy:6s} peak {gib(placed.device + placed.activations(t))} per rank (activations, "
            f"gradients, temporaries {gib(placed.activations(t))}){_host_text(placed, t)}, recompute "
            f"+{t.recompute:.1%} ({t.rung}), {t.collectives} collectives, {t.comm_bytes / 2**20:.1f} MiB sent "
            f"per rank per step{time_text(t)}"
        )
    return out


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = load_model_config(args.model)
    dtype = _DTYPES[args.dtype]
    policies = [x.strip() for x in args.checkpoint.split(",") if x.strip()]
    bad = [x for x in policies if x not in _POLICIES]
    if bad:
        ap.error(f"--checkpoint {bad}: use none, auto, full, budget")
    try:
        dev = device(args.device) if args.device else None
    except ValueError as e:
        ap.error(str(e))
    memory = args.memory or (dev.hbm_bytes if dev is not None else None)
    if not args.seq and not memory:
        ap.error("pass --seq (report a length) and/or --memory or --device (find the longest sequence that fits)")
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.sp)
    t0 = time.perf_counter()
    say = (lambda *a, **k: None) if args.json else print
    placed = _placement(
        cfg, dtype, args.optimizer, _shards(args.fsdp, args.sp, args.dp, dev.per_node if dev else 8), args.cpu_offload
    )
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    where = f" sharded over {placed.shards} ranks" if placed.shards > 1 else ""
    where += ", on the host (CPU offload)" if placed.offload else ""
    say(
        f"autosp plan: {args.model}, sp={args.sp}, dp={args.dp}, {args.dtype}, {args.optimizer}, batch {args.batch}: "
        f"parameters {gib(placed.params)} and optimizer state {gib(placed.optimizer)}{where}: {gib(placed.device)} "
        f"per rank on the device, {gib(placed.host)} on the host"
    )
    granule = 256 * args.sp
    base = args.seq or 16 * granule
    fit = PlanFit(
        cfg,
        sp=args.sp,
        seqs=(base, 2 * base),
        batch=args.batch,
        dtype=dtype,
        attention=args.attention,
        ulysses=args.ulysses,
        offload=args.offload,
        device=args.device,
        attention_kernel=args.attention_kernel,
    )
    kernels = sorted(
        {
            note.split(": ")[-1].split(",")[0].split(" (")[0]
            for note in fit.plans[(fit.LAYERS[0], base)].notes
            if note.startswith("attention at")
        }
    )
    attention = "; ".join(kernels) if kernels else "Ulysses, heads split evenly"
    attention = "whole (an sp group of one rank)" if args.sp == 1 else attention
    gpu = [
        n.split(": ", 1)[1].split(" (")[0]
        for n in fit.plans[(fit.LAYERS[0], base)].notes
        if n.startswith("attention kernel:")
    ]
    attention = f"{', '.join(gpu)} kernel: {attention}" if gpu else attention
    say(f"attention ({args.attention}): {attention}")

    def time_text(t: Traced) -> str:
        if dev is None:
            return ""
        return f", {t.step_time(dev, args.sp):.2f} s a step on {dev.name} at peak (roofline)"

    # the host memory of a node, shared by its ranks
    host = None if args.host_memory is None else args.host_memory // min(args.sp * args.dp, dev.per_node if dev else 8)

    def fitting(t: Traced) -> bool:
        on_host = host is None or placed.host + t.host <= host
        return memory is not None and placed.device + placed.activations(t) <= memory and on_host

    at_seq = _at_seq(fit, policies, args, placed, fitting, say, time_text) if args.seq else {}
    longest = _longest(fit, policies, memory, placed, granule, args.sp, say, time_text, host) if memory else {}
    seconds = time.perf_counter() - t0
    say(f"planned in {seconds:.0f} s")
    if args.json:
        # the longest any rung reaches where a memory is given, else the default's
        policy = next((p for p in ("budget", "auto") if p in policies and (p != "budget" or memory)), policies[0])
        seq, t = longest.get(policy, (None, None))
        t = at_seq.get(policy, t)  # the figures at --seq, else at the longest length
        print(json.dumps(_summary(args, dev, memory, placed, policy, seq, t, attention, seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
