"""What the gloo workers run (module-level, so spawn can import them). Each returns plain data;
the tests in test_*.py state the invariants."""

from __future__ import annotations

import copy
import hashlib
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental import register_sharding

import autosp
from examples.models import GPT, GPTConfig, Llama, LlamaBlock, LlamaConfig

MODELS = {
    "llama": lambda: Llama(LlamaConfig()),
    "llama_manual": lambda: Llama(LlamaConfig(attn="manual")),
    "llama_mha": lambda: Llama(LlamaConfig(heads=4, kv_heads=4)),
    "llama_mqa": lambda: Llama(LlamaConfig(heads=4, kv_heads=1)),
    "llama_2h": lambda: Llama(LlamaConfig(heads=2, kv_heads=1)),  # fewer query heads than 4 ranks
    "llama_6h": lambda: Llama(LlamaConfig(dim=96, heads=6, kv_heads=2)),  # 6 heads: uneven over 4
    "llama_6h_manual": lambda: Llama(LlamaConfig(dim=96, heads=6, kv_heads=3, attn="manual")),
    "llama_gqa": lambda: Llama(LlamaConfig(attn="gqa")),  # 4 query / 2 K/V heads inside SDPA (enable_gqa)
    "llama_vocab": lambda: Llama(LlamaConfig(vocab=2048)),  # logits 32 times the width: more tiles than the layers
    "gpt": lambda: GPT(GPTConfig()),
    "gpt_vocab": lambda: GPT(GPTConfig(vocab=2048)),  # tied logits 32 times the width
}


def batch(kind: str, b: int, L: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, L), generator=g)
    if kind.startswith("gpt"):  # GPT takes labels already shifted; -1 is ignored
        labels = torch.cat([ids[:, 1:], torch.full((b, 1), -1)], dim=1)
    else:
        labels = torch.randint(0, 256, (b, L), generator=g)
        labels[:, : L // 8] = -100
    return ids, labels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def exactness(
    kind: str,
    b: int,
    L: int,
    steps: int = 3,
    compiler: str = "aot_eager",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    checkpoint="auto",
    attention="auto",
    ulysses: int | None = None,
    offload: bool = False,
    dynamic: bool | None = None,
) -> dict:
    """Loss and grads of the first step, and parameters after ``steps`` AdamW steps, against the
    same model trained on one device (in this process, on the full batch, on ``device``)."""
    torch.manual_seed(0)
    model = MODELS[kind]().to(device, dtype)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    out = {}
    with autosp.mesh(ulysses=ulysses):
        step = autosp.shard(
            lambda input_ids, labels: model(input_ids, labels),
            compiler=compiler,
            checkpoint=checkpoint,
            attention=attention,
            offload=offload,
            **({} if dynamic is None else {"dynamic": dynamic}),
        )
        for i in range(steps):
            ids, labels = (t.to(device) for t in batch(kind, b, L, seed=i))
            loss = step(ids, labels)
            loss.backward()
            loss_ref = ref(ids, labels)
            loss_ref.backward()
            if i == 0:
                out["loss"] = (loss.item(), loss_ref.item())
                out["grad_err"] = {
                    n: _rel(p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())
                }
            opt.step()
            opt.zero_grad()
            opt_ref.step()
            opt_ref.zero_grad()
    out["param_err"] = max(_rel(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    out["planned"] = step.plan is not None
    out["checkpoint"] = step.plan.checkpoint.chosen if step.plan is not None else None
    out["host"] = step.plan.memory.host if step.plan is not None else 0
    out["kinds"] = sorted({c.kind for c in step.plan.collectives}) if step.plan is not None else []
    return out


def no_grad_exactness(kind: str, b: int, L: int) -> dict:
    """The loss of a step under ``torch.no_grad()`` (evaluation: a forward-only plan) against one
    device's, this rank's forward matmul FLOPs against one device's, the plan's collectives."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    ids, labels = batch(kind, b, L, seed=0)
    with autosp.mesh(), torch.no_grad():
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")
        loss, loss_ref = step(ids, labels), model(ids, labels)
        flops = (_matmul_flops(lambda: step(ids, labels), False), _matmul_flops(lambda: model(ids, labels), False))
    return dict(
        loss=(loss.item(), loss_ref.item()),
        flops=flops,
        kinds=sorted({c.kind for c in step.plan.collectives}),
        notes=list(step.plan.notes),
    )


def _gloo_events(prof) -> list[tuple[str, int]]:
    out = []
    for e in prof.events():
        if e.name.startswith("gloo:"):
            numel = 0
            for shape in e.input_shapes[:1]:
                n = 1
                for s in shape:
                    n *= s
                numel += n
            out.append((e.name, numel))
    return out


def comm(kind: str, b: int, L: int, checkpoint="auto") -> dict:
    """The collectives gloo ran in one training step (after a warm-up step), for autosp and for
    hand-written Ulysses on the same model and batch: [(event name, elements)]. autosp's step
    without its input check ("autosp", what the plan runs) and with it ("autosp_checked")."""
    from examples.ulysses import allreduce_grads, ulysses_loss

    torch.manual_seed(0)
    model = MODELS[kind]()
    ids, labels = batch(kind, b, L, seed=0)
    res = {}
    with autosp.mesh():
        for key, check in (("autosp", False), ("autosp_checked", True)):
            step = autosp.shard(
                lambda input_ids, labels: model(input_ids, labels),
                compiler="aot_eager",
                checkpoint=checkpoint,
                check_inputs=check,
            )
            step(ids, labels).backward()
            with torch.profiler.profile(record_shapes=True) as prof:
                step(ids, labels).backward()
            res[key] = _gloo_events(prof)
        res["plan"] = [(c.kind, c.backward, c.shape) for c in step.plan.collectives]
    model.zero_grad()
    local, _ = ulysses_loss(model, ids, labels)
    local.backward()
    allreduce_grads(model)
    with torch.profiler.profile(record_shapes=True) as prof:
        local, _ = ulysses_loss(model, ids, labels)
        local.backward()
        allreduce_grads(model)
    res["ulysses"] = _gloo_events(prof)
    return res


def work(kind: str, b: int, L: int) -> dict:
    """Matmul FLOPs (torch.profiler with_flops) and bytes saved for backward (non-parameter
    tensors), per rank for the autosp step and for the single-device step on the full batch."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    ids, labels = batch(kind, b, L, seed=0)
    params = {p.data_ptr() for p in model.parameters()}

    def measure(fn):
        fn().backward()
        saved = {}

        def pack(t):
            if t.data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with (
            torch.profiler.profile(with_flops=True) as prof,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            fn().backward()
        flops = sum(e.flops for e in prof.events() if e.flops)
        return flops, sum(saved.values())

    with autosp.mesh():
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")
        sharded = measure(lambda: step(ids, labels))
    single_fn = torch.compile(lambda input_ids, labels: model(input_ids, labels), backend="aot_eager", fullgraph=True)
    single = measure(lambda: single_fn(ids, labels))
    return {"flops": (sharded[0], single[0]), "saved": (sharded[1], single[1])}


def world_of_one_work(kind: str, b: int, L: int) -> dict:
    """A world of one (no torchrun): the gloo events of one training step after a warm-up (none
    should run: the sp group's collectives are removed), and ``work``'s FLOPs and saved bytes."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    ids, labels = batch(kind, b, L, seed=0)
    with autosp.mesh():
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")
        step(ids, labels).backward()
        with torch.profiler.profile(record_shapes=True) as prof:
            step(ids, labels).backward()
        plan = step.plan
    return {"gloo": _gloo_events(prof), "planned": plan is not None, "rows": len(plan.collectives), **work(kind, b, L)}


def _step_error(kind: str, b: int, L: int, check_inputs: bool = True, seed: int = 0, **mesh_kwargs) -> str:
    """Run one sharded step; return the error it raised, or "no error"."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    ids, labels = batch(kind, b, L, seed=seed)
    with autosp.mesh(**mesh_kwargs):
        step = autosp.shard(
            lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager", check_inputs=check_inputs
        )
        try:
            step(ids, labels).backward()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return "no error"


def error_message(kind: str, b: int, L_by_rank: list[int], check_inputs: bool = True) -> str:
    """Run a step whose sequence length differs per rank; return the error each rank raises."""
    return _step_error(kind, b, L_by_rank[dist.get_rank()], check_inputs)


def redistribute_roundtrip(shape: list[int], src: str, dst: str, seed: int) -> float:
    """Max abs error of redistribute(src -> dst) on a random global tensor, against cutting the
    global tensor for dst directly with torch.tensor_split (the balanced split autosp uses, uneven
    when n does not divide a block); Partial sources: random parts that sum to it."""
    from autosp.partition._collectives import redistribute
    from autosp.propagate._placement import parse_placement, shard_spec

    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g, dtype=torch.float64)
    parts = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n - 1)]
    p, q = parse_placement(src), parse_placement(dst)

    def local(t, pl):
        spec = shard_spec(pl)
        if spec is None:
            return t
        d, sf = spec
        blocks = t.reshape(shape[:d] + [sf, shape[d] // sf] + shape[d + 1 :])
        mine = torch.tensor_split(blocks, n, dim=d + 1)[r]
        return mine.reshape(shape[:d] + [-1] + shape[d + 1 :])

    if src.startswith("P"):
        x = parts[r] if r < n - 1 else full - sum(parts)
    else:
        x = local(full, p)
    group = dist.group.WORLD.group_name
    y = redistribute(x.contiguous(), p, q, n, r, group, shape)
    y = torch.distributed._functional_collectives.wait_tensor(y) if hasattr(y, "wait") else y
    want = local(full, q)
    assert y.shape == want.shape, (tuple(y.shape), tuple(want.shape))
    return (y - want).abs().max().item() if want.numel() else 0.0


def skip_on_rank(skip: int, timeout_s: float, check_inputs: bool = True) -> str:
    """Every rank but ``skip`` runs a sharded step; return what each rank saw."""
    if dist.get_rank() == skip:
        return "skipped"
    return _step_error("llama", 1, 96, check_inputs, timeout_s=timeout_s)


def die_mid_step(die: int, timeout_s: float) -> dict:
    """Steps of a sharded model; after the first, rank ``die`` exits 0.3 s later (mid-step, or
    between steps if they are shorter): the error the other ranks saw, and how long after the
    first step it came."""
    import os
    import threading
    import time

    torch.manual_seed(0)
    model = MODELS["llama"]()
    ids, labels = batch("llama", 2, 1024, seed=0)
    with autosp.mesh(timeout_s=timeout_s):
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")
        step(ids, labels).backward()
        if dist.get_rank() == die:
            threading.Timer(0.3, lambda: os._exit(1)).start()
        t0 = time.monotonic()
        try:
            for _ in range(20):
                step(ids, labels).backward()
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return {"error": "no error", "seconds": time.monotonic() - t0}


def error_of(fn, *args) -> str:
    """``fn(*args)``'s error on this rank, as its type and message, or "no error"."""
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def inputs_per_rank(dp: int, differ_in_group: bool, check: bool = True) -> str:
    """A step whose ranks get their dp replica's batch (dp replicas differ, as a sampler over dp
    hands them out); with ``differ_in_group`` the last rank's batch also differs from the rest of
    its sp group (a sampler over every rank): the error each rank raises, or "no error"."""
    r, world = dist.get_rank(), dist.get_world_size()
    seed = r // (world // dp) + (100 if differ_in_group and r == world - 1 else 0)  # the mesh is (dp, sp)
    return _step_error("llama", 1, 64, check, seed=seed, dp=dp)


def annotated_exactness() -> tuple[float, float, list]:
    """A model whose code pins an intermediate replicated with autosp.annotate: (loss, reference
    loss, the plan's all-gathers)."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def step(ids):
        h = emb(ids)
        h = autosp.annotate(h, "b s d")  # hard constraint: replicated here
        return torch.nn.functional.cross_entropy(head(h).flatten(0, 1), ids.flatten())

    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = step(ids)
    with autosp.mesh():
        sharded = autosp.shard(step, compiler="aot_eager")
        loss = sharded(ids)
    return loss.item(), ref.item(), [(c.kind, c.source) for c in sharded.plan.collectives if c.kind == "all_gather"]


def _grad_errors(model, ref) -> dict[str, float]:
    """Each gradient's largest error relative to its largest element; a gradient that is zero in
    exact arithmetic (a bias under a shift-invariant loss, an attention key bias) is roundoff on
    both sides: its error is measured against 1e-4 of the model's largest gradient."""
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters()) if q.grad is not None]
    floor = 1e-4 * max(g.abs().max().item() for _, _, g in pairs)
    return {n: ((a - b).abs().max() / max(b.abs().max().item(), floor)).item() for n, a, b in pairs}


_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _matmul_flops(fn, backward: bool = True) -> float:
    """The matmul FLOPs of ``fn().backward()`` (``fn()`` alone without ``backward``) on this rank
    (torch.profiler's count)."""
    with torch.profiler.profile(with_flops=True) as prof:
        out = fn()
        if backward:
            out.backward()
    return float(sum(e.flops for e in prof.events() if e.flops and e.name in _MATMULS))


def _square_rows(fn, L: int) -> int:
    """The most rows of any (..., rows, L) tensor an op reads on this rank in ``fn().backward()``
    (torch.profiler's recorded input shapes), for a sequence of L: a whole (L, L) mask has L,
    one split by query rows its rank's share."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn().backward()
    shapes = [
        s
        for e in prof.events()
        if e.name not in _VIEWS  # a view of a model's buffer (GPT-2's causal bias) is no tensor of the step
        for s in e.input_shapes
        if len(s) == 4 and s[-1] == L
    ]
    return max((s[-2] for s in shapes), default=0)


_VIEWS = {f"aten::{op}" for op in ("slice", "as_strided", "view", "expand", "select", "narrow", "alias", "unsqueeze")}


def _against_one_device(model, ref, loss_fn, *inputs):
    """``loss_fn(model, *inputs)`` as one sharded step and ``loss_fn(ref, *inputs)`` on one
    device, a backward each: (the loss pair, each gradient's error, the sharded step, and the
    matmul FLOPs of one more step of each: (this rank's, one device's)). Nothing is recomputed
    (``checkpoint="none"``), so the FLOPs are the split's alone: these cases test rules, and
    checkpointing has its own tests."""
    with autosp.mesh():
        step = autosp.shard(lambda *a: loss_fn(model, *a), compiler="aot_eager", checkpoint="none")
        loss = step(*inputs)
        loss.backward()
        loss_ref = loss_fn(ref, *inputs)
        loss_ref.backward()
        err = _grad_errors(model, ref)
        flops = (_matmul_flops(lambda: step(*inputs)), _matmul_flops(lambda: loss_fn(ref, *inputs)))
    return (loss.item(), loss_ref.item()), err, step, flops


class MarkedBlock(LlamaBlock):
    """The example Llama's block as a user marks it to be compiled once."""

    forward = torch.compiler.nested_compile_region(LlamaBlock.forward)


def region_exactness(form: str, lengths: list[int]) -> dict:
    """The example Llama (3 layers, 4 heads) at each of ``lengths`` (a symbolic length: one
    compile) against one device, its blocks marked by the user with ``nested_compile_region``
    (``form="marked"``), captured once by autosp (``"outlined"``, the default) or traced each
    (``"traced"``, ``blocks_once=False``). Per length: the loss pair, each gradient's error and the
    matmul FLOPs (this rank's, one device's); the plan's notes and collective kinds, the compiles,
    and how many times AOTAutograd traced a block's joint graph."""
    import importlib

    hop = importlib.import_module("torch._higher_order_ops.invoke_subgraph")  # the module, not the op
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=4, kv_heads=4, layers=3))
    if form == "marked":
        for block in model.blocks:
            block.__class__ = MarkedBlock
    ref = copy.deepcopy(model)
    traced, joint = [], hop.trace_joint_graph_as_bwd

    def counted(*a, **k):
        traced.append(1)
        return joint(*a, **k)

    hop.trace_joint_graph_as_bwd = counted
    out, compiled = {"steps": []}, _compiles()
    try:
        with autosp.mesh():
            step = autosp.shard(
                lambda *a: model(*a), compiler="aot_eager", checkpoint="none", blocks_once=form != "traced"
            )
            for i, L in enumerate(lengths):
                ids, labels = batch("llama", 1, L, seed=i)
                loss = step(ids, labels)
                loss.backward()
                loss_ref = ref(ids, labels)
                loss_ref.backward()
                flops = (
                    _matmul_flops(lambda ids=ids, labels=labels: step(ids, labels)),
                    _matmul_flops(lambda ids=ids, labels=labels: ref(ids, labels)),
                )
                out["steps"].append(
                    {"loss": (loss.item(), loss_ref.item()), "err": _grad_errors(model, ref), "flops": flops}
                )
                for p in (*model.parameters(), *ref.parameters()):
                    p.grad = None
    finally:
        hop.trace_joint_graph_as_bwd = joint
    out["notes"] = step.plan.notes
    out["kinds"] = sorted({c.kind for c in step.plan.collectives})
    out["graphs"] = _compiles() - compiled
    out["block_traces"] = len(traced)
    return out


# Reductions users write over activations, along the sequence and over every dim: the ones whose
# partial results do not add (a maximum, a minimum, a p-norm) are reduced as such, not summed
REDUCTIONS = {
    "max": lambda h: h.abs().max(),
    "min": lambda h: h.min(),
    "amax": lambda h: h.amax(),
    "amax_seq": lambda h: h.amax(dim=1).sum(),
    "amin_seq_keepdim": lambda h: (h - h.amin(dim=1, keepdim=True)).pow(2).mean(),
    "max_ties": lambda h: h.max(),
    "vector_norm_seq": lambda h: torch.linalg.vector_norm(h, dim=1).sum(),
    "norm": lambda h: h.norm(),
    "vector_norm_3_seq": lambda h: torch.linalg.vector_norm(h, ord=3, dim=1).sum(),
    "std_seq": lambda h: h.std(dim=1).sum(),
    "var_seq_keepdim": lambda h: (h.var(dim=1, keepdim=True, correction=0) * h).mean(),
    "prod_seq": lambda h: (h.tanh() * 0.1 + 1).prod(dim=1).sum(),
    "prod": lambda h: (h.tanh() * 0.01 + 1).prod(),  # DTensor offers a partial product here
    "logsumexp_seq": lambda h: h.logsumexp(dim=1).sum(),
    # the values carry the gradient, the indices weigh them: a wrong winner changes the loss
    "max_dim_seq": lambda h: (torch.max(h, -2).values * (1 + h.argmin(dim=1))).sum(),  # dims both ways
    "min_dim_seq_keepdim_ties": lambda h: (lambda m: (m.values * (1 + m.indices)).sum())(h.min(1, keepdim=True)),
    "max_dim_ties": lambda h: (h.max(dim=1).values * (1 + h.argmax(dim=1))).sum(),
    # over every token of the batch: the flattened dim is a strided shard (each sequence's rows)
    "max_dim_flat_tokens": lambda h: (lambda m: (m.values * (1 + m.indices)).sum())(h.flatten(0, 1).max(0)),
    # running sums along the sequence (naive causal linear attention, cumulative log decays); the
    # reverse one written as users write it, by flips
    "cumsum_seq": lambda h: (h.cumsum(1) * h).mean(),
    "logcumsumexp_seq": lambda h: h.logcumsumexp(1).mean(),
    "reverse_cumsum_seq": lambda h: (torch.flip(h, [-2]).cumsum(-2).flip(-2) * h.tanh()).mean(),
    "cumprod_seq": lambda h: ((h.tanh() * 0.1 + 1).cumprod(1) * h).mean(),
}


def reduction_exactness(kind: str, b: int, L: int) -> dict:
    """A loss that reduces a sequence-sharded activation with ``REDUCTIONS[kind]``: loss and
    gradients against one device, and the plan's collectives as (kind, source placement). No
    bias: a shift-invariant reduction (a standard deviation) gives it no gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16, bias=False))
    ref = copy.deepcopy(model)
    vocab = 4 if kind.endswith("_ties") else 64  # the largest element recurs, on every rank
    ids = torch.randint(0, vocab, (b, L), generator=torch.Generator().manual_seed(1))
    loss, err, step, flops = _against_one_device(model, ref, lambda m, ids: REDUCTIONS[kind](m(ids)), ids)
    return {
        "loss": loss,
        "grad_err": err,
        "flops": flops,
        "collectives": sorted({(c.kind, c.src) for c in step.plan.collectives}),
        "scatters": sorted({p for name, ps in step.plan.placements.items() if name.startswith("scatter") for p in ps}),
    }


def _token_shift(h, pad):
    """RWKV's token shift: each position mixes in the previous one's features."""
    return h + 0.5 * (pad(h) - h)


def _causal_conv_by_slices(h, k: int = 3):
    """A causal depthwise convolution written as a sum of shifted slices of the left-padded input."""
    L = h.shape[1]
    hp = torch.nn.functional.pad(h, (0, 0, k - 1, 0))
    return sum((t + 1) / k * hp[:, t : t + L] for t in range(k))


def _conv(conv, h, L=None):
    """A 1-d convolution over the sequence of (batch, sequence, channels), cut to ``L`` rows."""
    return conv(h.transpose(1, 2))[..., :L].transpose(1, 2)


# Shifts along the sequence as users write them, each (hidden, input_ids, modules) -> (logits-to-be,
# targets): the logits-shift loss, a token shift (F.pad, ZeroPad2d, cat of shifted pieces, a masked
# roll), a causal convolution by slices, a slice with both ends, a pad with a value, a roll that
# wraps around, a flip along the features and one along the sequence too, and convolution modules along the sequence:
# Mamba's causal depthwise one (padded by k - 1 each side, cut to the length) and a dense, dilated,
# "same"-padded one; and sliding windows by unfold (a hand-written convolution's)
SHIFTS = {
    "logits_shift": lambda h, ids, m: (h[:, :-1], ids[:, 1:]),
    "token_shift_pad": lambda h, ids, m: (_token_shift(h, lambda x: torch.nn.functional.pad(x, (0, 0, 1, -1))), ids),
    "token_shift_zeropad2d": lambda h, ids, m: (_token_shift(h, torch.nn.ZeroPad2d((0, 0, 1, -1))), ids),
    "conv_by_slices": lambda h, ids, m: (_causal_conv_by_slices(h), ids),
    "slice_both_ends": lambda h, ids, m: (h[:, 2:-1], ids[:, 1:-2]),
    "pad_value": lambda h, ids, m: (torch.nn.functional.pad(h, (0, 0, 2, 1), value=0.25)[:, 3:], ids),
    "token_shift_cat": lambda h, ids, m: (
        _token_shift(h, lambda x: torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)),
        ids,
    ),
    "roll_masked": lambda h, ids, m: (
        _token_shift(h, lambda x: torch.roll(x, 1, 1) * (torch.arange(x.shape[1]) > 0)[None, :, None]),
        ids,
    ),
    "roll_wrap": lambda h, ids, m: (h + torch.roll(h, -2, dims=1), ids),
    "flip_features": lambda h, ids, m: (h + 0.5 * h.flip(-1), ids),
    "flip_sequence": lambda h, ids, m: (h + 0.5 * h.flip(1, 2), ids),
    "conv1d_causal": lambda h, ids, m: (torch.nn.functional.silu(_conv(m[3], h, h.shape[1])), ids),
    "conv1d_same_dilated": lambda h, ids, m: (_conv(m[4], h), ids),
    "unfold_window": lambda h, ids, m: ((h.unfold(1, 4, 1) * torch.linspace(0.2, 1.0, 4)).sum(-1), ids[:, 3:]),
    # the same windows, written as a loop of slices stacked
    "windows_by_slices": lambda h, ids, m: (
        (torch.stack([h[:, i : h.shape[1] - 3 + i] for i in range(4)], -1) * torch.linspace(0.2, 1.0, 4)).sum(-1),
        ids[:, 3:],
    ),
}


def _shift_model(kind: str):
    """(modules, loss function of (modules, ids)) of ``SHIFTS[kind]``: an embedding, a linear
    layer, the shift along the sequence, a head and a cross-entropy (a vocabulary of 64)."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.ModuleList(
        [
            nn.Embedding(64, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 64),
            nn.Conv1d(16, 16, 4, groups=16, padding=3),
            nn.Conv1d(16, 16, 3, padding=2, dilation=2),
        ]
    )

    def fn(m, ids):
        h, targets = SHIFTS[kind](m[1](m[0](ids)), ids, m)
        return torch.nn.functional.cross_entropy(m[2](h).flatten(0, 1), targets.flatten())

    return model, fn


def shift_exactness(kind: str, b: int, L: int) -> dict:
    """An embedding, a linear layer, ``SHIFTS[kind]`` along the sequence, a head and a
    cross-entropy: loss and gradients against one device, and the plan's collectives as
    (kind, source placement)."""
    model, fn = _shift_model(kind)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (b, L), generator=torch.Generator().manual_seed(1))
    loss, err, step, flops = _against_one_device(model, ref, fn, ids)
    return {
        "loss": loss,
        "grad_err": err,
        "flops": flops,
        "collectives": sorted({(c.kind, c.src) for c in step.plan.collectives}),
        "halo_bytes": [c.bytes_per_rank for c in step.plan.collectives if c.kind == "halo"],
    }


class ComplexRopeAttention(torch.nn.Module):
    """Attention with RoPE in complex arithmetic, as Meta's reference Llama and torchtitan write it:
    ``torch.polar`` frequencies, ``view_as_complex``, a complex product, ``view_as_real``."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        nn = torch.nn
        self.heads, self.hd = heads, dim // heads
        self.embed, self.out = nn.Embedding(64, dim), nn.Linear(dim, 64)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def _rope(self, x, cis):
        b, t = x.shape[:2]
        xc = torch.view_as_complex(x.float().reshape(b, t, self.heads, self.hd // 2, 2))
        return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3).type_as(x)

    def forward(self, ids):
        b, t = ids.shape
        h = self.embed(ids)
        inv = 1.0 / 10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)
        angles = torch.outer(torch.arange(t).float(), inv)
        cis = torch.polar(torch.ones_like(angles), angles)
        q, k, v = (p(h).view(b, t, self.heads, self.hd) for p in (self.q, self.k, self.v))
        q, k = self._rope(q, cis), self._rope(k, cis)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        logits = self.out(self.o(o.transpose(1, 2).reshape(b, t, -1)))
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _per_token_solve(h):
    """A unit lower-triangular solve per token (4 x 4 from 16 features), as chunked delta rules
    solve per chunk."""
    g = h.unflatten(-1, (4, 4))
    lower = torch.tril(g, -1) * 0.1 + torch.eye(4)
    return torch.linalg.solve_triangular(lower, g, upper=False).flatten(-2)


# ops on activations with no rule of DTensor's or a pointwise tag of torch's: activation functions
# whose gradients are untagged (Mamba's softplus, ...), log-sigmoid (gated linear attention's
# gates), a triangular solve per token
def _orderings(h):
    """A router's orderings along the features, written the ways users write them: on the tokens
    flattened (a strided shard of a batch of sequences) and on (b, s, d); topk, sort (stable,
    descending), argsort; gathered and scattered back along the features."""
    flat = h.reshape(-1, h.shape[-1])
    v, i = flat.topk(4, dim=-1)
    routed = torch.zeros_like(flat).scatter(-1, i, v.softmax(-1)).view_as(h)
    s, _ = torch.sort(h, dim=-1, stable=True, descending=True)
    ranked = flat.gather(1, torch.argsort(flat, dim=1)).view(h.shape)
    top, _ = torch.topk(h, 2, dim=2, largest=False)
    return routed + 0.5 * s + 0.25 * ranked + top.sum(-1, keepdim=True)


def _indexed_writes(h):
    """Writes into a buffer the ways a chunked scan writes: one index of a dim at a time
    (``out[:, :, i] = ...``: Qwen3-Next's delta rule), and a slice of the features
    (``out[..., 1:3] = ...``); under Dynamo, ``select_scatter`` and ``slice_scatter`` through the
    whole of the dims before them, the sequence's included."""
    g = h.unflatten(-1, (4, 4))
    out = torch.zeros_like(g)
    for i in range(4):
        out[:, :, i] = g[:, :, i] * (i + 1)
    out[..., 1:3] = out[..., 1:3] + g[..., :2]
    return out.flatten(-2)


@torch.library.custom_op("autosp_cases::bucket_add", mutates_args=())
def bucket_add(x: torch.Tensor, idx: torch.Tensor, buckets: int) -> torch.Tensor:
    """A custom scatter-add: each feature j of every token added into bucket ``idx[j]``."""
    out = x.new_zeros(*x.shape[:-1], buckets)
    return out.index_add_(-1, idx, x)


@bucket_add.register_fake
def _(x, idx, buckets):
    return x.new_empty(*x.shape[:-1], buckets)


def _bucket_add_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.shape = inputs[0].shape


def _bucket_add_backward(ctx, g):
    (idx,) = ctx.saved_tensors
    return g.gather(-1, idx.expand(ctx.shape)), None, None


bucket_add.register_autograd(_bucket_add_backward, setup_context=_bucket_add_setup)


@register_sharding(torch.ops.autosp_cases.bucket_add.default)
def _bucket_add_sharding(x, idx, buckets):
    """The user's rule: per token, so split alike along any dim but the features."""
    from torch.distributed.tensor import Replicate, Shard

    alike = [([Shard(d)], [Shard(d), Replicate(), None]) for d in range(len(x.shape) - 1)]
    return [([Replicate()], [Replicate(), Replicate(), None]), *alike]


OPS = {
    "orderings": _orderings,
    # a custom op given a rule by the user (DTensor's register_sharding)
    "registered_custom_op": lambda h: (
        bucket_add(h, torch.arange(h.shape[-1]) % 5, 5).sigmoid().repeat(1, 1, 4)[..., :16]
    ),
    "indexed_writes": _indexed_writes,
    "activations": lambda h: sum(
        f(h)
        for f in (
            torch.nn.functional.softplus,
            torch.nn.functional.elu,
            torch.nn.functional.leaky_relu,
            torch.nn.functional.hardtanh,
            torch.nn.functional.mish,
            torch.nn.functional.hardswish,
            torch.nn.functional.hardsigmoid,
            torch.nn.functional.softshrink,
            torch.nn.functional.hardshrink,
            torch.nn.functional.logsigmoid,
            # GLU halves its dim (autosp's rule: elementwise along the others)
            lambda x: torch.nn.functional.glu(torch.cat([x, 2 * x], -1)),
        )
    ),
    "solve_triangular": _per_token_solve,
}


def op_exactness(kind: str, b: int, L: int) -> dict:
    """An embedding, a linear layer, ``OPS[kind]``, a head and a cross-entropy against one device,
    and the plan's collective kinds."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.ModuleList([nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64)])
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (b, L), generator=torch.Generator().manual_seed(1))

    def fn(m, ids):
        return torch.nn.functional.cross_entropy(m[2](OPS[kind](m[1](m[0](ids)))).flatten(0, 1), ids.flatten())

    loss, err, step, flops = _against_one_device(model, ref, fn, ids)
    return {
        "loss": loss,
        "grad_err": err,
        "flops": flops,
        "kinds": sorted({c.kind for c in step.plan.collectives}),
    }


def complex_rope_exactness(b: int, L: int) -> dict:
    """``ComplexRopeAttention``: loss and gradients against one device, and the plan's collective kinds."""
    torch.manual_seed(0)
    model = ComplexRopeAttention()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (b, L), generator=torch.Generator().manual_seed(1))
    loss, err, step, flops = _against_one_device(model, ref, lambda m, ids: m(ids), ids)
    return {
        "loss": loss,
        "grad_err": err,
        "flops": flops,
        "kinds": sorted({c.kind for c in step.plan.collectives}),
        "all_to_alls": step.plan.count("all_to_all"),
    }


# reductions drawn by tests/test_property.py: (op, dims, keepdim) over (b, L, 16) activations,
# dims None (every element), the sequence (1), the features (2) or both
REDUCTIONS_DRAWN = {
    "sum": lambda h, d, k: h.sum() if d is None else h.sum(d, keepdim=k),
    "mean": lambda h, d, k: h.mean() if d is None else h.mean(d, keepdim=k),
    "amax": lambda h, d, k: h.amax() if d is None else h.amax(d, keepdim=k),
    "amin": lambda h, d, k: h.amin() if d is None else h.amin(d, keepdim=k),
    "max": lambda h, d, k: h.max() if d is None else h.amax(d, keepdim=k) if len(d) > 1 else h.max(d[0], k).values,
    "min": lambda h, d, k: h.min() if d is None else h.amin(d, keepdim=k) if len(d) > 1 else h.min(d[0], k).values,
    "norm1": lambda h, d, k: torch.linalg.vector_norm(h, 1, dim=d, keepdim=k),
    "norm2": lambda h, d, k: torch.linalg.vector_norm(h, 2, dim=d, keepdim=k),
    "norm3": lambda h, d, k: torch.linalg.vector_norm(h, 3, dim=d, keepdim=k),
    "logsumexp": lambda h, d, k: h.logsumexp(d or (0, 1, 2), keepdim=k),
    "var": lambda h, d, k: h.var() if d is None else h.var(d, keepdim=k),
    "std": lambda h, d, k: h.std() if d is None else h.std(d, keepdim=k),
    "prod": lambda h, d, k: (h.tanh() * 0.05 + 1).prod() if d is None else (h.tanh() * 0.05 + 1).prod(d[0], keepdim=k),
}


def splits_along_sequence(op: str, dims) -> bool:
    """Whether the reduction's per-rank partial results along the sequence are combined as such
    (summed, all-reduced MAX or MIN, p-th powers summed) or merged (log-sum-exps, variances,
    ``x.max(dim)`` with its index, products along a dim); a product of every element reads its
    input whole (DTensor's partial product is refused)."""
    return not (op == "prod" and dims is None)


def drawn_reduction_exactness(op: str, dims, keepdim: bool, L: int) -> dict:
    """``REDUCTIONS_DRAWN[op]`` of a sequence-sharded activation, weighted and summed into a loss: loss
    and gradients against one device, and whether the plan all-gathered an activation."""
    dims = None if dims is None else tuple(dims)

    def loss_of(h):
        r = REDUCTIONS_DRAWN[op](h, dims, keepdim)
        return (r * torch.linspace(0.5, 1.5, r.numel()).view(r.shape)).sum()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16, bias=False))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, L), generator=torch.Generator().manual_seed(1))
    loss, err, step, flops = _against_one_device(model, ref, lambda m, ids: loss_of(m(ids)), ids)
    return {
        "loss": loss,
        "grad_err": err,
        "flops": flops,
        "gathered": any(c.kind == "all_gather" for c in step.plan.collectives),
    }


def _hf_compare(
    model, ref, ids: torch.Tensor, labels: torch.Tensor, attention: str = "auto", dynamic: bool = False, **kwargs
) -> dict:
    """Train one step of an HF causal LM through autosp and the same on one device; the loss pair,
    each gradient's relative error (``_grad_errors``: an attention key bias's gradient is zero in
    exact arithmetic, softmax ignoring a shift of every score in a row), the plan's collective
    kinds, and the matmul FLOPs of one more forward of each, (this rank's, one device's): the
    forward only, as the backward's recompute (``checkpoint="auto"``) is no split's."""

    def call(m, input_ids, labels, **kw):
        return m(input_ids=input_ids, labels=labels, **kw).loss

    with autosp.mesh():
        step = autosp.shard(
            lambda input_ids, labels, **kw: call(model, input_ids, labels, **kw),
            compiler="aot_eager",
            attention=attention,
            dynamic=dynamic,
        )
        loss = step(ids, labels, **kwargs)
        loss.backward()
        kinds = sorted({c.kind for c in step.plan.collectives})
        loss_ref = call(ref, ids, labels, **kwargs)
        loss_ref.backward()
        err = _grad_errors(model, ref)
        flops = (
            _matmul_flops(lambda: step(ids, labels, **kwargs), backward=False),
            _matmul_flops(lambda: call(ref, ids, labels, **kwargs), backward=False),
        )
        rows = _square_rows(lambda: step(ids, labels, **kwargs), ids.shape[1])
        with torch.profiler.profile(record_shapes=True) as prof:
            step(ids, labels, **kwargs)
    return {
        "gpu_kernels": _gpu_kernel_queries(prof),
        "notes": list(step.plan.notes),
        "loss": (loss.item(), loss_ref.item()),
        "grad_err": err,
        "kinds": kinds,
        "flops": flops,
        "square_rows": rows,
    }


def hf_exactness(
    arch: str, attn: str, b: int, L: int, generic: bool = False, experts: str | None = None, dynamic: bool = False
) -> dict:
    """A Hugging Face causal LM, unmodified, with the loss it computes from ``labels`` (``experts``:
    a mixture-of-experts model's experts implementation; ``dynamic``: a symbolic length)."""
    import hf_models

    model = hf_models.build_generic(arch, attn, experts) if generic else hf_models.build(arch, attn)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (b, L), generator=g)
    labels = ids.clone()
    labels[:, : L // 4] = -100
    return _hf_compare(model, ref, ids, labels, dynamic=dynamic)


def gpu_kernel_hf_exactness(arch: str, b: int, L: int, kernel: str | None = None) -> dict:
    """``hf_exactness`` with attention captured as a CUDA kernel (None: the one SDPA picks on the
    GPU; Hugging Face's SDPA path passes a mask under torch.compile, so memory-efficient), run by
    its CPU reference."""
    import cuda_reference  # noqa: F401  registers the CPU reference kernels

    from autosp._attention_ops import gpu_attention

    with gpu_attention(kernel):
        return hf_exactness(arch, "sdpa", b, L)


def hf_moe_autocast(L: int = 64) -> dict:
    """Mixtral with HF's "eager" experts (a linear per expert, which autocast runs in bf16), one
    step under bf16 autocast inside the sharded step (as the Trainer's ``bf16=True``) and the same
    on one device: the loss pair, and the autocast state each experts call ran under at run time
    (the token-local op's kernel runs the layer outside the traced graph)."""
    import hf_models

    model = hf_models.build_generic("mixtral", "sdpa", "eager")
    ref = copy.deepcopy(model)
    seen = []

    def record(module, args):
        if not torch.compiler.is_compiling():
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m.register_forward_pre_hook(record)
    ids = torch.randint(0, 128, (1, L), generator=torch.Generator().manual_seed(0))

    def call(m, input_ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(input_ids=input_ids, labels=input_ids).loss.float()

    with autosp.mesh():
        step = autosp.shard(lambda input_ids: call(model, input_ids), compiler="aot_eager")
        loss = step(ids)
        loss.backward()
    return {"loss": (loss.item(), call(ref, ids).item()), "autocast": sorted(set(map(str, seen)))}


class TopKMoE(torch.nn.Module):
    """A mixture-of-experts MLP as users write it: a softmax router, each token's top 2 experts,
    no capacity limit; ``form`` the dispatch: "where" (``torch.where`` per expert, then
    ``index_add_``), "sort" (tokens sorted by expert, ``bincount`` and ``split`` by the counts,
    then ``index_add_``). Token-local as a whole, though no op of either dispatch is."""

    def __init__(self, d: int, experts: int, hidden: int, form: str, k: int = 2):
        super().__init__()
        self.k, self.experts, self.form = k, experts, form
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts, d, hidden) / d**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, d) / hidden**0.5)

    def expert(self, e: int, x):
        return torch.nn.functional.silu(x @ self.w1[e]) @ self.w2[e]

    def forward(self, x):
        b, s, d = x.shape
        x = x.reshape(-1, d)
        w, idx = self.router(x).softmax(-1).topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        if self.form == "where":
            for e in range(self.experts):
                tok, slot = torch.where(idx == e)
                out.index_add_(0, tok, self.expert(e, x[tok]) * w[tok, slot, None])
        else:
            flat = idx.flatten()
            order = flat.argsort(stable=True)
            tok = order // self.k
            counts = torch.bincount(flat, minlength=self.experts).tolist()
            y = torch.cat([self.expert(e, xe) for e, xe in enumerate(x[tok].split(counts))])
            out.index_add_(0, tok, y * w.flatten()[order, None])
        return out.view(b, s, d)


class _PinnedMoE(TopKMoE):
    """The layer's tokens pinned replicated (``autosp.annotate(x, "b s d")``), as the error for
    its dispatch advises."""

    def forward(self, x):
        return super().forward(autosp.annotate(x, "b s d"))


class MoEModel(torch.nn.Module):
    """Causal attention, then a ``TopKMoE``, and a next-token loss from the labels; ``mark``: the
    MoE as it is (None), marked ``autosp.token_local`` ("token_local"), or with its tokens pinned
    replicated ("replicated")."""

    def __init__(self, form: str, mark: str | None, d: int = 32, heads: int = 4, vocab: int = 128):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)
        moe = (_PinnedMoE if mark == "replicated" else TopKMoE)(d, 4, 48, form)
        self.moe = autosp.token_local(moe) if mark == "token_local" else moe
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids, labels):
        h = self.embed(ids)
        b, s, d = h.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, s, d))
        h = h + self.moe(self.norm(h))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def handwritten_moe(form: str, mark: str, b: int, L: int) -> dict:
    """``MoEModel(form, mark)``: one step sharded and on one device; the matmul FLOPs of the
    forward only (the token-local op's backward runs the experts' forward again), and the
    placements of the ``nonzero`` nodes (a data-dependent count of rows)."""
    torch.manual_seed(0)
    model = MoEModel(form, mark)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (b, L), generator=torch.Generator().manual_seed(0))
    loss, err, step, _ = _against_one_device(model, ref, lambda m, i: m(i, i), ids)
    with autosp.mesh():
        flops = (_matmul_flops(lambda: step(ids), backward=False), _matmul_flops(lambda: ref(ids, ids), backward=False))
    counts = sorted({p for name, ps in step.plan.placements.items() if name.startswith("nonzero") for p in ps})
    return {
        "loss": loss,
        "grad_err": err,
        "flops": flops,
        "kinds": sorted({c.kind for c in step.plan.collectives}),
        "counts": counts,
    }


def _token_losses(logits, targets):
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=-100
    ).view(targets.shape)


def _preshift(ids):
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


# Losses users write, each a function of (model, input_ids, labels) -> scalar. The labels a case
# gets are built by LOSS_LABELS below; several put every valid token on some ranks and none on others.
LOSS_FNS = {
    # the model's own loss: causal shift inside, mean over valid tokens (HF's convention)
    "shift_inside": lambda m, ids, labels: m(ids, labels),
    # labels shifted by the data pipeline; the model never sees them
    "preshifted": lambda m, ids, labels: torch.nn.functional.cross_entropy(
        m(ids).flatten(0, 1), labels.flatten(), ignore_index=-100
    ),
    # a masked sum divided by a count, written out
    "masked_sum_over_count": lambda m, ids, labels: (
        (_token_losses(m(ids), labels) * (labels != -100)).sum() / (labels != -100).sum()
    ),
    # a plain sum (the caller divides later, e.g. by tokens in the whole accumulation window)
    "sum": lambda m, ids, labels: _token_losses(m(ids), labels).sum(),
    # per-sequence means, then the mean over the batch (sample-weighted, not token-weighted)
    "per_sequence_mean": lambda m, ids, labels: (
        _token_losses(m(ids), labels).sum(1) / (labels != -100).sum(1).clamp_min(1)
    ).mean(),
    # token mean plus a z-loss on the log-partition (PaLM)
    "z_loss": lambda m, ids, labels: (
        torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
        + 1e-4 * m(ids).logsumexp(-1).pow(2).mean()
    ),
}


def _loss_labels(case: str, b: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) for a loss case; the labels skew the valid tokens across ranks."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (b, L), generator=g)
    labels = ids.clone() if case == "shift_inside" else _preshift(ids)
    n = dist.get_world_size()
    labels[:, : L - L // n] = -100  # every valid label on the last rank's shard
    if b > 1:
        labels[1, : L // 2] = ids[1, 1 : L // 2 + 1]  # ...except in row 1, valid on the first half
    return ids, labels


def loss_exactness(case: str, b: int, L: int) -> dict:
    """A user-written loss over the Llama example: loss and grads against one device."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    ref = copy.deepcopy(model)
    ids, labels = _loss_labels(case, b, L)
    fn = LOSS_FNS[case]
    with autosp.mesh():
        step = autosp.shard(lambda input_ids, labels: fn(model, input_ids, labels), compiler="aot_eager")
        loss = step(ids, labels)
        loss.backward()
    loss_ref = fn(ref, ids, labels)
    loss_ref.backward()
    return {
        "loss": (loss.item(), loss_ref.item()),
        "grad_err": {n: _rel(p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())},
        "planned": step.plan is not None,
    }


# Losses over the logits a user writes with the logits in tiles (``tiled_loss_exactness``): LOSS_FNS'
# that read the logits, and HF's causal-LM form, which shifts the logits rather than the labels
TILED_LOSSES = {
    **{k: LOSS_FNS[k] for k in ("preshifted", "z_loss", "per_sequence_mean")},
    "logits_shift": lambda m, ids, labels: torch.nn.functional.cross_entropy(
        m(ids)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    ),
}


def tiled_loss_exactness(case: str, L: int, compiler: str = "aot_eager", dynamic: bool = False) -> dict:
    """``TILED_LOSSES[case]`` over the Llama example with a vocabulary 32 times its width, the
    logits and loss in tiles sized by memory (forced, from 2 rows a tile: ``tiled``), one step in
    fp32 against one device; and the rung that ran."""
    torch.manual_seed(0)
    model = MODELS["llama_vocab"]()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, L), generator=g)
    labels = ids.clone() if case == "logits_shift" else _preshift(ids)
    labels[:, : L // 4] = -100
    fn = TILED_LOSSES[case]
    with autosp.mesh():
        step = autosp.shard(
            lambda input_ids, labels: fn(model, input_ids, labels),
            compiler=compiler,
            checkpoint="full",
            dynamic=dynamic,
        )
        loss = tiled(step, ids, labels, min_rows=2)
        loss.backward()
    loss_ref = fn(ref, ids, labels)
    loss_ref.backward()
    return {
        "loss": (loss.item(), loss_ref.item()),
        "grad_err": _grad_errors(model, ref),
        "checkpoint": step.plan.checkpoint.chosen,
        "kinds": sorted({c.kind for c in step.plan.collectives}),
    }


def low_precision(mode: str, b: int, L: int) -> dict:
    """bf16 training, three ways users run it: bf16 parameters ("bf16"), fp32 parameters under
    CPU autocast to bf16 ("autocast"), or FSDP2 with fp32 shards computing in bf16 and reducing
    gradients in fp32 ("fsdp_bf16"; on one device: the bf16 model). Returns, for the sharded step
    and for the same step on one device, the loss and the worst relative gradient error, both
    against an fp64 run."""
    torch.manual_seed(0)
    base = MODELS["llama"]()
    ids, labels = batch("llama", b, L, seed=0)
    ref = copy.deepcopy(base).double()
    ref(ids, labels).backward()

    def run(model, fn):
        loss = fn(ids, labels)
        loss.backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        err = max(_rel(g.double(), q.grad) for g, q in zip(grads, ref.parameters()))
        return loss.item(), err

    def make(sharded: bool = False):
        model = copy.deepcopy(base)
        if mode == "bf16":
            return model.to(torch.bfloat16), lambda i, y: model(i, y)
        if mode == "fsdp_bf16":  # fp32 shards, bf16 compute, fp32 gradient reduction
            if sharded:
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for block in model.blocks:
                    fully_shard(block, mp_policy=mp)
                fully_shard(model, mp_policy=mp)
                return model, lambda i, y: model(i, y)
            model = model.to(torch.bfloat16)  # one device: the same bf16 compute
            return model, lambda i, y: model(i, y)

        def fn(i, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(i, y)

        return model, fn

    single_model, single_fn = make()
    single = run(single_model, single_fn)
    with autosp.mesh():
        model, fn = make(sharded=True)
        step = autosp.shard(lambda input_ids, labels: fn(input_ids, labels), compiler="aot_eager")
        sharded = run(model, step)
    return {
        "sharded": sharded,
        "single": single,
        "fp64_loss": ref(ids, labels).item(),
        "planned": step.plan is not None,
    }


def hf_masked_exactness(arch: str, attn: str, kind: str, b: int, L: int, attention: str = "auto") -> dict:
    """A Hugging Face causal LM fed what real batches carry: a padding ``attention_mask`` (kind
    "right" or "left", rows padded by different amounts, labels -100 on the padding) or packed
    documents whose ``position_ids`` restart at each document start ("packed": HF builds the
    document-causal mask from them). Loss and grads against one device."""
    import hf_models

    model = hf_models.build(arch, attn)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (b, L), generator=g)
    labels = ids.clone()
    kwargs = {}
    if kind in ("right", "left"):
        mask = torch.ones(b, L, dtype=torch.long)
        for row in range(b):
            pad = (row + 1) * L // (2 * b + 1)  # different per row, crossing shard boundaries
            sl = slice(L - pad, L) if kind == "right" else slice(0, pad)
            mask[row, sl] = 0
            labels[row, sl] = -100
        kwargs["attention_mask"] = mask
    elif kind == "packed":
        starts = [0, L // 3 + 1, L // 2 + 3]  # documents that straddle the shards
        pos = torch.zeros(b, L, dtype=torch.long)
        for s, e in zip(starts, starts[1:] + [L]):
            pos[:, s:e] = torch.arange(e - s)
        kwargs["position_ids"] = pos
        labels[:, starts] = -100  # no prediction across a document boundary
    else:
        raise ValueError(kind)
    return _hf_compare(model, ref, ids, labels, attention, **kwargs)


def random_hf_exactness(cfg: dict) -> dict:
    """A random small Hugging Face Llama (``cfg``: layers, heads, kv_heads, head_dim, b, L, pad,
    attn), rows right-padded by up to ``pad`` tokens (attention_mask 0, labels -100 there)."""
    import hf_models  # noqa: F401 - sets the offline flag
    import transformers as T

    c = T.LlamaConfig(
        hidden_size=cfg["heads"] * cfg["head_dim"],
        intermediate_size=48,
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        head_dim=cfg["head_dim"],
        num_hidden_layers=cfg["layers"],
        vocab_size=64,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(c, attn_implementation=cfg["attn"])
    model.loss_type = "ForCausalLM"
    ref = copy.deepcopy(model)
    b, L = cfg["b"], cfg["L"]
    g = torch.Generator().manual_seed(cfg["L"])
    ids = torch.randint(0, 64, (b, L), generator=g)
    labels, mask = ids.clone(), torch.ones(b, L, dtype=torch.long)
    for row in range(b):
        pad = cfg["pad"] // (row + 1)
        if pad:
            mask[row, L - pad :] = 0
            labels[row, L - pad :] = -100
    return _hf_compare(model, ref, ids, labels, **({"attention_mask": mask} if cfg["pad"] else {}))


def dropout_run(p: float) -> dict:
    """A Hugging Face GPT-2 with every dropout at ``p``, trained through autosp: two runs from the
    same seed, and the dropout op itself on a known input."""
    import hf_models  # noqa: F401 - offline flag
    import transformers as T

    cfg = T.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        vocab_size=128,
        use_cache=False,
        resid_pdrop=p,
        embd_pdrop=p,
        attn_pdrop=p,
    )
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.loss_type = "ForCausalLM"
    model.train()
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    out = {}
    with autosp.mesh():
        step = autosp.shard(
            lambda input_ids, labels: model(input_ids=input_ids, labels=labels).loss, compiler="aot_eager"
        )
        for run in (0, 1):
            torch.manual_seed(123)
            model.zero_grad()
            loss = step(ids, ids)
            loss.backward()
            out[f"loss{run}"] = loss.item()
            out[f"grads{run}"] = torch.cat([q.grad.reshape(-1) for q in model.parameters()]).clone()
            out[f"next{run}"] = torch.rand(()).item()  # the default generator after the step
        model.eval()  # no dropout: another graph
        out["loss_eval"] = step(ids, ids).item()
    out["grad_digest"] = out["grads0"].double().sum().item(), out["grads0"].abs().double().sum().item()
    out["runs_differ"] = (out["grads0"] - out["grads1"]).abs().max().item()
    del out["grads0"], out["grads1"]
    torch.manual_seed(5)
    y, mask = torch.ops.autosp.dropout(torch.ones(4096), 0.5, dist.get_rank())
    out["mask_frac"] = mask.float().mean().item()
    out["mask_digest"] = hashlib.sha256(mask.numpy().tobytes()).hexdigest()  # hash() differs per process
    out["scaled"] = sorted(set(y.tolist()))
    return out


def dp_exactness(kind: str, b: int, L: int, dp: int) -> dict:
    """A dp x sp mesh: each dp replica is called with its own slice of a global batch (as a
    sampler over the dp replicas hands it out), trains on it sequence-parallel within its sp
    group, and the gradients are averaged over the replicas, as DDP does. Against one device
    running the same slices: each replica's loss, and the mean of the slices' gradients."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    ref = copy.deepcopy(model)
    ids, labels = batch(kind, b, L, seed=0)
    with autosp.mesh(dp=dp) as m:
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")
        loss = step(ids.tensor_split(dp)[m.dp_rank], labels.tensor_split(dp)[m.dp_rank])
        loss.backward()
        r, sp = m.dp_rank, m.sp_size
    losses = [ref(i, y) for i, y in zip(ids.tensor_split(dp), labels.tensor_split(dp))]
    (sum(losses) / dp).backward()
    return {
        "loss": (loss.item(), losses[r].item()),
        "sp": sp,
        "grad_err": {n: _rel(p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())},
    }


def gqa_op_exactness(L: int) -> dict:
    """Grouped-query attention inside the op (6 query heads, 2 K/V heads, enable_gqa) on the
    ranks of the pool: loss and input gradient against the same step on one device."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 6 * 8 + 2 * 2 * 8)

    def step(x):
        b, s, _ = x.shape
        q, k, v = proj(x).split([48, 16, 16], dim=-1)
        q = q.view(b, s, 6, 8).transpose(1, 2)
        k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return (o * o).sum()

    x = torch.randn(2, L, 16, generator=torch.Generator().manual_seed(1))
    with autosp.mesh():
        sharded = autosp.shard(step, compiler="aot_eager")
        loss = sharded(x)
        loss.backward()
        grads = [p.grad.clone() for p in proj.parameters()]
        proj.zero_grad()
        ref = step(x)
        ref.backward()
    return {
        "loss": (loss.item(), ref.item()),
        "grad_err": max(_rel(g, p.grad) for g, p in zip(grads, proj.parameters())),
        "notes": list(sharded.plan.notes),
    }


def largest_peaks() -> list[int]:
    """The budget decision's exchange: each rank offers its own rung peaks (rank-dependent, as
    with uneven shards); every rank must get the same per-rung maxima."""
    from autosp.backend import Options, SpContext
    from autosp.backend._checks import largest_peaks

    with autosp.mesh() as m:
        r = dist.get_rank()
        return largest_peaks(SpContext.of(m, Options()))([100 + r, 50 - r, 10 * (r + 1)])


def _document_mask(S: int, dtype: torch.dtype) -> torch.Tensor:
    """A document-causal additive mask (documents start at S/3 + 1 and S/2 + 3) with query row 1
    masked out entirely (-inf everywhere: the kernel's out and log-sum-exp are 0 there)."""
    doc = torch.zeros(S, dtype=torch.long)
    doc[S // 3 + 1 :] += 1
    doc[S // 2 + 3 :] += 1
    i = torch.arange(S)
    ok = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    ok[1] = False
    return torch.zeros(S, S, dtype=dtype).masked_fill(~ok, float("-inf")).expand(2, 1, S, S)


def ring_kernel(
    S: int, causal: bool, dtype: torch.dtype = torch.float64, heads: tuple[int, int] = (3, 3), mask: bool = False
) -> dict:
    """Ring attention's forward and backward on this rank's chunks of q, k, v (and of the output's
    gradient) against the CPU attention kernel on the whole sequence: the largest error of the
    output, log-sum-exp and the three gradients, relative, and the gloo collectives that ran.
    ``mask``: a document mask (``_document_mask``) instead of ``causal``."""
    from autosp.partition._attention import ring_attention, ring_attention_backward
    from autosp.propagate._attention import bounds as _bounds
    from autosp.propagate._attention import ring_bytes

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    g = torch.Generator().manual_seed(S)
    H, KV = heads
    q, go = (torch.randn(2, H, S, 8, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, KV, S, 8, generator=g, dtype=dtype) for _ in range(2))
    m = _document_mask(S, dtype) if mask else None
    out, lse = flash(q, k, v, 0.0, causal, attn_mask=m)[:2]
    ref = (out, lse, *flash_bwd(go, q, k, v, out, lse, 0.0, causal, attn_mask=m))
    r, n = dist.get_rank(), dist.get_world_size()
    a, b = _bounds(S, n)[r]
    mine = [t.narrow(2, a, b - a).contiguous() for t in (q, k, v, go)]
    kw = dict(S=S, rank=r, n=n, group=dist.group.WORLD, is_causal=causal, attn_mask=m)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        o, lse_r = ring_attention(*mine[:3], **kw)
        grads = ring_attention_backward(mine[3], *mine[:3], out.narrow(2, a, b - a), lse.narrow(2, a, b - a), **kw)
        o, lse_r, *grads = (x * 1 for x in (o, lse_r, *grads))  # waits for the last exchanges inside the profile
    # relative to the whole reference (a row's own gradient can be 0: one query seeing one key)
    errs = [
        ((x - y.narrow(2, a, b - a)).abs().max() / y.abs().max()).item() if x.numel() else 0.0
        for x, y in zip((o, lse_r, *grads), ref)
    ]
    events = _gloo_events(prof)
    return {
        "err": max(errs),
        "events": events,
        "sent": sum(numel for _, numel in events) * q.element_size(),
        "planned": sum(ring_bytes(q, k, v, n, causal)),
    }


def schedule_mismatch() -> str:
    """Partitioned graphs that issue a different number of collectives on each rank (traced on
    fake tensors, so nothing runs): the schedule check must refuse them on every rank."""
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from autosp.backend import Options, SpContext
    from autosp.backend._checks import check_same_schedule

    with autosp.mesh() as m:

        def f(x):
            for _ in range(1 + dist.get_rank()):
                x = funcol.all_reduce(x, "sum", m.sp_group.group_name)
            return x * 1

        gm = make_fx(f, tracing_mode="fake")(torch.ones(2))
        try:
            check_same_schedule(gm, gm, SpContext.of(m, Options()))
        except autosp.PlanError as e:
            return str(e)
    return ""


def hybrid_kernel(S: int, causal: bool, heads: tuple[int, int] = (4, 2), u: int = 2) -> dict:
    """Hybrid attention's forward and backward (Ulysses within sub-groups of ``u`` ranks, ring
    across) on this rank's chunks, against the CPU kernel on the whole sequence (fp64): the
    largest relative error, the gloo bytes sent and ``hybrid_bytes``' charge."""
    from autosp.partition._attention import hybrid_attention, hybrid_attention_backward
    from autosp.propagate._attention import bounds as _bounds
    from autosp.propagate._attention import hybrid_bytes

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    g = torch.Generator().manual_seed(S)
    H, KV = heads
    q, go = (torch.randn(2, H, S, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, KV, S, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = flash(q, k, v, 0.0, causal)[:2]
    ref = (out, lse, *flash_bwd(go, q, k, v, out, lse, 0.0, causal))
    with autosp.mesh(ulysses=u) as m:
        r, n = m.sp_rank, m.sp_size
        a, b = _bounds(S, n)[r]
        mine = [t.narrow(2, a, b - a).contiguous() for t in (q, k, v, go)]
        inner, outer = m.hybrid_groups
        kw = dict(S=S, rank=r, n=n, u=u, inner=inner, outer=outer, is_causal=causal)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            o, lse_r = hybrid_attention(*mine[:3], **kw)
            grads = hybrid_attention_backward(
                mine[3], *mine[:3], out.narrow(2, a, b - a), lse.narrow(2, a, b - a), **kw
            )
            o, lse_r, *grads = (x * 1 for x in (o, lse_r, *grads))
    errs = [((x - y.narrow(2, a, b - a)).abs().max() / y.abs().max()).item() for x, y in zip((o, lse_r, *grads), ref)]
    events = _gloo_events(prof)
    # gloo's all-to-all events count the whole input, this rank's own 1/u of each tensor included
    own = sum(t.numel() for t in (*mine[:3], o, *mine[:3], o, mine[3], *grads)) * 8 + 2 * lse_r.numel() * 8
    return {
        "err": max(errs),
        "sent": sum(numel for _, numel in events) * 8 - own / u,
        "planned": sum(hybrid_bytes(q, k, v, n, u, causal)),
    }


def fsdp_exactness(
    kind: str,
    b: int,
    L: int,
    dp: int,
    over: str,
    steps: int = 2,
    reshard: bool = True,
    dtype: torch.dtype = torch.float64,
    as_module: bool = False,
    offload: bool = False,
) -> dict:
    """FSDP2 (``fully_shard`` per block and on the model) under ``autosp.shard`` on a dp x sp mesh,
    parameters sharded ``over`` "dp", "sp", "hsdp" (the autosp mesh: sharded over sp, replicated
    over dp) or "world". Against one device on the same slices with DDP's averaging: each step's
    loss, the first step's gradients (gathered from their shards), the parameters after the AdamW
    steps; and the gathers that ran in the last step (forward and, resharded, backward).
    ``as_module``: ``autosp.shard(model)`` instead of a step function. ``offload``: FSDP2's
    ``CPUOffloadPolicy`` (unpinned: no accelerator here), its shards and their gradients on the
    host (``grads_on_host``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = MODELS[kind]().to(dtype)
    ref = copy.deepcopy(model)
    full_numel = sum(p.numel() for p in model.parameters())
    with autosp.mesh(dp=dp) as m:
        mesh = {
            "dp": lambda: m.device_mesh["dp"],
            "sp": lambda: m.device_mesh["sp"],
            "hsdp": lambda: m.device_mesh,
            "world": lambda: init_device_mesh("cpu", (dist.get_world_size(),)),
        }[over]()
        policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        if as_module:  # autosp.shard(model): FSDP2's own hooks on the root must not run first
            step = autosp.shard(model, compiler="aot_eager")
        else:
            step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")
        losses = []
        for i in range(steps):
            ids, labels = batch(kind, b, L, seed=i)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as fwd:
                loss = step(ids.tensor_split(dp)[m.dp_rank], labels.tensor_split(dp)[m.dp_rank])
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as bwd:
                loss.backward()
            ref_losses = [ref(x, y) for x, y in zip(ids.tensor_split(dp), labels.tensor_split(dp))]
            (sum(ref_losses) / dp).backward()
            losses.append((loss.item(), ref_losses[m.dp_rank].item()))
            if i == 0:
                assert all(isinstance(p.grad, DTensor) for p in model.parameters())
                grad_err = {
                    n: _rel(p.grad.full_tensor(), q.grad)
                    for (n, p), q in zip(model.named_parameters(), ref.parameters())
                }
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        # what ran, as the profiler recorded it: the gather op calls (each issues one gloo all-gather
        # inside) and the gloo all-gathers themselves, forward and backward
        ran = [
            (
                sum(e.name == "autosp::fsdp_gather" for e in prof.events()),
                sum(e.name == "gloo:all_gather" for e in prof.events()),
            )
            for prof in (fwd, bwd)
        ]
        local_numel = sum(p.to_local().numel() for p in model.parameters())
        state_numel = sum(
            t.to_local().numel() for s in opt.state.values() for t in s.values() if isinstance(t, DTensor)
        )
        param_err = max(_rel(p.full_tensor(), q) for p, q in zip(model.parameters(), ref.parameters()))
        notes = list((model.forward if as_module else step).plan.notes)
    return {
        "notes": notes,
        "losses": losses,
        "grad_err": grad_err,
        "param_err": param_err,
        "full_numel": full_numel,
        "local_numel": local_numel,
        "state_numel": state_numel,
        "shard_ranks": mesh.size(mesh.ndim - 1),
        "params": len(list(model.parameters())),
        "block_params": len(list(model.blocks.parameters())),
        "gathers": ran,
    }


def fsdp_ops(over: str) -> dict:
    """The gather and its gradient on the layouts ``fully_shard`` leaves (DTensor's ``Shard(d)``:
    ceil(size / ranks) rows, the last ranks fewer or none), against the full tensor and the sum
    of every rank's contribution; and the error for an FSDP2 mixed-precision policy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from autosp.partition._fsdp import fsdp_gather, fsdp_reduce

    r, world = dist.get_rank(), dist.get_world_size()
    out = {}
    with autosp.mesh(dp=2) as m:
        mesh = {"dp": m.device_mesh["dp"], "world": init_device_mesh("cpu", (world,))}[over]
        group, n = mesh.get_group(), mesh.size()
        outer = m.sp_group.group_name if over == "dp" else ""
        for size, dim in [(10, 0), (3, 0), (6, 1), (8, 0)]:
            shape = [size, 5] if dim == 0 else [4, size]
            full = torch.randn(shape, generator=torch.Generator().manual_seed(size), dtype=torch.float64)
            shard = distribute_tensor(full, mesh, [Shard(dim)]).to_local()
            got = fsdp_gather(shard, dim, size, n, outer, 2, True, full.dtype, full.dtype, group.group_name)
            contrib = [
                torch.randn(shape, generator=torch.Generator().manual_seed(100 + k), dtype=torch.float64)
                for k in range(world)
            ]
            reduced = fsdp_reduce(
                contrib[r], dim, shard.shape[dim], n, outer, 2, full.dtype, full.dtype, group.group_name
            )
            want = distribute_tensor(sum(contrib) / 2, mesh, [Shard(dim)]).to_local()
            out[(size, dim)] = (
                tuple(shard.shape),
                (got - full).abs().max().item(),
                (reduced - want).abs().max().item() if want.numel() else 0.0,
                tuple(reduced.shape) == tuple(want.shape),
            )
        model = MODELS["llama"]()
        fully_shard(
            model,
            mesh=m.device_mesh["dp"],
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32),
        )
        try:
            autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")(
                *batch("llama", 2, 16, 0)
            )
            out["error"] = None
        except ValueError as e:
            out["error"] = str(e)
        # a parameter whose gradient comes from replicated data only (Replicate over sp, not Partial)
        torch.manual_seed(0)
        net = torch.nn.ModuleDict({"lin": torch.nn.Linear(8, 8), "extra": torch.nn.Linear(6, 5)})
        ref = copy.deepcopy(net)
        for sub in net.values():  # two top-level FSDP modules
            fully_shard(sub, mesh=mesh)
        x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(3))

        def loss_fn(net, x):
            return net["lin"](x).pow(2).mean() + net["extra"].weight.pow(2).sum()

        autosp.shard(lambda x: loss_fn(net, x), compiler="aot_eager")(x).backward()
        loss_fn(ref, x).backward()  # dp replicas take halves of the batch: the mean of their losses
        out["replicated_grad"] = max(
            _rel(p.grad.full_tensor(), q.grad) for p, q in zip(net.parameters(), ref.parameters()) if p.grad is not None
        )
        net["lin"].set_requires_gradient_sync(False)
        try:
            autosp.shard(lambda x: loss_fn(net, x), compiler="aot_eager")(x)
            out["no_sync"] = None
        except ValueError as e:
            out["no_sync"] = str(e)
        hidden = {"models": [fully_shard(MODELS["llama"](), mesh=m.device_mesh["dp"])]}  # two levels down
        try:
            autosp.shard(lambda input_ids, labels: hidden["models"][0](input_ids, labels), compiler="aot_eager")(
                *batch("llama", 2, 16, 0)
            )
            out["hidden"] = None
        except autosp.GraphBreakError as e:
            out["hidden"] = str(e)
    return out


def whole_layers(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with every checkpointing decision taking the last "whole layers"
    rung it weighed (a budget weighs them; with ``offload=True`` the last is an offloaded one)."""
    from autosp.partition import _checkpoint

    select = _checkpoint.select

    def last_whole(policy, rungs, peaks=None):
        whole = [r for r in rungs if r.spec.kind == "layers"]
        return whole[-1] if whole else select(policy, rungs, peaks)

    _checkpoint.select = last_whole
    try:
        return fn(*args, **kwargs)
    finally:
        _checkpoint.select = select


def tiled(fn, *args, min_rows: int = 8, **kwargs):
    """``fn(*args, **kwargs)`` with sequence tiling from ``min_rows`` rows a tile (the default,
    ``MIN_TILE_ROWS``, keeps the short test sequences untiled), and checkpoint="full" taking the
    last tiled rung ("full + loss, N tiles"; on these small graphs the untiled "full" would
    predict less memory and be taken)."""
    from autosp.partition import _checkpoint, _tiling

    keep, select = _tiling.MIN_TILE_ROWS, _checkpoint.select

    def last_tiled(policy, rungs, peaks=None):
        tiled = [r for r in rungs if r.spec.tiles > 1]
        return tiled[-1] if policy == "full" and tiled else select(policy, rungs, peaks)

    _tiling.MIN_TILE_ROWS, _checkpoint.select = min_rows, last_tiled
    try:
        return fn(*args, **kwargs)
    finally:
        _tiling.MIN_TILE_ROWS, _checkpoint.select = keep, select


def _compiles() -> int:
    """The graphs Dynamo has compiled in this process so far (its own count)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _chunked_loss(logits, labels):  # per-row losses of 4 chunks, concatenated
    pairs = zip(torch.chunk(logits.reshape(-1, logits.shape[-1]), 4), torch.chunk(labels.reshape(-1), 4))
    return torch.cat([torch.nn.functional.cross_entropy(x.float(), y, reduction="none") for x, y in pairs]).mean()


def _summed_chunks(logits, labels):  # a loop adding per-chunk sums
    loss = 0
    for x, y in zip(torch.chunk(logits.reshape(-1, logits.shape[-1]), 4), torch.chunk(labels.reshape(-1), 4)):
        loss = loss + torch.nn.functional.cross_entropy(x, y, reduction="sum")
    return loss / labels.numel()


def _torchtune_chunks(logits, labels):  # torchtune's CEWithChunkedOutputLoss: chunks along the sequence
    total = 0.0
    for x, y in zip(logits.chunk(4, dim=1), labels.chunk(4, dim=1)):
        total += torch.nn.functional.cross_entropy(x.reshape(-1, x.size(-1)).float(), y.reshape(-1), reduction="sum")
    return total / labels.numel()


# ``many_lengths`` kinds "<a model of MODELS><suffix>": its logits-shift loss over 4 chunks of the rows
_CHUNKED_LOSSES = {
    "_chunked_loss": _chunked_loss,
    "_summed_chunks": _summed_chunks,
    "_torchtune_chunks": _torchtune_chunks,
}


def _peer_model(name: str):
    import peer_models

    return (*peer_models.BUILDERS[name](), peer_models.VOCAB)


def _reduction_model(name: str):
    """(model, vocab, loss function) of ``REDUCTIONS[name]`` over an embedding and a linear layer
    (``reduction_exactness``'s)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16, bias=False))
    return model, 4 if name.endswith("_ties") else 64, lambda m, ids: REDUCTIONS[name](m(ids))


def _op_model(name: str):
    """(model, vocab, loss function) of ``OPS[name]`` between a linear layer and a head
    (``op_exactness``'s)."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.ModuleList([nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64)])

    def fn(m, ids):
        return torch.nn.functional.cross_entropy(m[2](OPS[name](m[1](m[0](ids)))).flatten(0, 1), ids.flatten())

    return model, 64, fn


# ``many_lengths`` kinds by prefix: a shift along the sequence of ``SHIFTS`` ("shift:conv1d_causal"),
# a reduction of ``REDUCTIONS`` ("reduction:amax_seq"), an op of ``OPS`` ("op:orderings"), a model of
# a peer library ("peer_litgpt_llama3_2"): (model, vocab, loss function)
_PREFIXED = {
    "op:": _op_model,
    "shift:": lambda name: (lambda model, fn: (model, 64, fn))(*_shift_model(name)),
    "reduction:": _reduction_model,
    "peer_": lambda name: (lambda model, fn, vocab: (model, vocab, fn))(*_peer_model(name)),
}


def _lengths_model(kind: str):
    """(model, vocab, loss function) of a ``many_lengths`` kind."""
    torch.manual_seed(0)
    if kind == "embed":
        model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
        vocab = 64

        def fn(m, ids):
            return torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())
    elif kind == "embed_shift_logits":  # the loss shifts the logits (length S - 1), not the labels
        model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
        vocab = 64

        def fn(m, ids):
            return torch.nn.functional.cross_entropy(m(ids)[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
    elif kind in ("embed_chunked", "embed_chunked_cat", "embed_chunked_ceil"):  # padded to a multiple of a
        # chunk (F.pad by -s % 16 or by 16 * ceil(s / 16) - s, or a cat of zeros), then scanned within chunks
        model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16))
        vocab = 64

        def fn(m, ids):
            h = m(ids)
            b, s, d = h.shape
            if kind == "embed_chunked":
                h = torch.nn.functional.pad(h, (0, 0, 0, (-s) % 16))
            elif kind == "embed_chunked_ceil":
                h = torch.nn.functional.pad(h, (0, 0, 0, 16 * math.ceil(s / 16) - s))
            else:
                h = torch.cat([h, h.new_zeros(b, (-s) % 16, d)], dim=1)
            return h.view(b, -1, 16, d).cumsum(2).pow(2).mean()
    elif kind.startswith("hf_"):  # a Hugging Face causal LM ("hf_llama": its sdpa attention) and its loss
        import hf_models

        arch = kind[3:]
        model = (hf_models.build if arch in hf_models.configs() else hf_models.build_generic)(arch, "sdpa")
        vocab = 128

        def fn(m, ids):
            return m(input_ids=ids, labels=ids).loss
    elif kind.startswith(tuple(_PREFIXED)):  # a model of ``SHIFTS`` or ``peer_models`` and its loss
        prefix = next(p for p in _PREFIXED if kind.startswith(p))
        model, vocab, fn = _PREFIXED[prefix](kind.removeprefix(prefix))
    elif kind.endswith(tuple(_CHUNKED_LOSSES)):  # a model of MODELS, its loss over 4 chunks of the rows
        suffix = next(x for x in _CHUNKED_LOSSES if kind.endswith(x))
        model, vocab = MODELS[kind.removesuffix(suffix)](), 256

        def fn(m, ids):
            return _CHUNKED_LOSSES[suffix](m(ids)[:, :-1], ids[:, 1:])
    elif kind.endswith("_shift_logits"):  # a model of MODELS, the loss shifting its logits
        model, vocab = MODELS[kind.removesuffix("_shift_logits")](), 256

        def fn(m, ids):
            logits = m(ids)
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    else:
        model, vocab = MODELS[kind](), 256

        def fn(m, ids):
            return m(ids, ids)

    return model, vocab, fn


def many_lengths(
    kind: str,
    lengths: list[int],
    limit: int = 8,
    dynamic: bool = True,
    min_tile_rows: int | None = None,
    checkpoint: str | int | None = None,
    compiler: str = "aot_eager",
) -> dict:
    """One sharded step of ``kind`` ("embed": an embedding and a projection with its loss; "hf_"
    and an architecture of ``hf_models``; or a model of ``MODELS``) called with each of
    ``lengths`` under Dynamo's recompile limit ``limit``:
    (loss, one device's loss, worst gradient error) per call, the compiled steps autosp keeps,
    the graphs Dynamo compiled in the sharded step's calls (its count; a reference's own compiles,
    torch's eager FlexAttention's, are not the step's), autosp's log lines about new shapes, and each call's
    checkpointing rung. ``min_tile_rows``: tile along the sequence from that many rows a tile
    (``tiled``; checkpoint="full" then takes the last tiled rung). ``checkpoint``: the policy
    (by default "auto", or "full" with ``min_tile_rows``). ``compiler``: the backend compiler
    (``"inductor"``, the default users run)."""
    import logging

    model, vocab, fn = _lengths_model(kind)
    ref = copy.deepcopy(model)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("autosp").addHandler(handler)
    steps, rungs, flops, graphs, errs = [], [], [], [], {}
    if checkpoint is None:
        checkpoint = "auto" if min_tile_rows is None else "full"
    notes: list[tuple[str, ...]] = []
    timings: list[dict[str, float]] = []

    def run():
        with torch._dynamo.config.patch(recompile_limit=limit), autosp.mesh():
            step = autosp.shard(lambda ids: fn(model, ids), compiler=compiler, dynamic=dynamic, checkpoint=checkpoint)
            for L in lengths:
                ids = torch.randint(0, vocab, (1, L), generator=torch.Generator().manual_seed(L))
                for p in [*model.parameters(), *ref.parameters()]:
                    p.grad = None
                compiled = _compiles()
                loss = step(ids)
                loss.backward()
                graphs.append(_compiles() - compiled)  # the sharded step's (not the reference's own)
                rungs.append(step.plan.checkpoint.chosen)
                notes.append(step.plan.notes)
                timings.append(dict(step.plan.timings))
                loss_ref = fn(ref, ids)
                loss_ref.backward()
                errs.update(_grad_errors(model, ref))
                steps.append((loss.item(), loss_ref.item(), max(errs.values())))
            flops.extend((_matmul_flops(lambda: step(ids)), _matmul_flops(lambda: fn(ref, ids))))
            return step

    try:
        step = run() if min_tile_rows is None else tiled(run, min_rows=min_tile_rows)
    finally:
        logging.getLogger("autosp").removeHandler(handler)
    return {
        "steps": steps,
        "compiled": len(step._compiled),
        "graphs": sum(graphs),
        "log": [m for m in lines if "new input shapes" in m or "compiling the step again" in m],
        "rungs": rungs,
        "notes": notes,
        "timings": timings,  # each call's compile's phase times (Plan.timings)
        "flops": flops,  # matmul FLOPs at the last length: this rank's, one device's
        "kinds": sorted({c.kind for c in step.plan.collectives}),  # the last length's plan
        "grad_err": errs,  # each parameter's gradient error at the last length
    }


def traced_ranks(kind: str, lengths: list[int]) -> dict:
    """``many_lengths(kind, lengths)`` on a symbolic length, counting the per-rank graphs this
    process traced (``localize`` calls, by the rank each was for): with ``rank_graph``, its own
    alone."""
    from autosp.backend import _backend

    traced, localize = [], _backend.localize

    def counting(graph, choice, inputs, ctx, **kw):
        traced.append(ctx.rank)
        return localize(graph, choice, inputs, ctx, **kw)

    _backend.localize = counting
    try:
        r = many_lengths(kind, lengths)
    finally:
        _backend.localize = localize
    return {"traced": traced, "rank": dist.get_rank(), **r}


def hang_on_rank(rank: int) -> str:
    """Rank ``rank`` never answers (sleeps for an hour); the others return at once."""
    import time

    if dist.get_rank() == rank:
        time.sleep(3600)
    return "answered"


def exit_in_collective(rank: int) -> str:
    """Rank ``rank`` exits (code 3) while the others wait for it in an all-reduce."""
    import os
    import time

    if dist.get_rank() == rank:
        time.sleep(1.0)  # the others are inside the all-reduce by now
        os._exit(3)
    dist.all_reduce(torch.ones(4))
    return "reduced"


def defaults_exactness(family: str, lengths: list[int], dp: int = 1) -> dict:
    """One training step of ``family`` at each of ``lengths`` under the defaults users run (Inductor,
    symbolic lengths), against one device: per length (loss, one device's loss, worst gradient
    error); the graphs compiled; the last plan's collective kinds; and this rank's matmul FLOPs
    at the last length against one device's (forward and backward). Families: "hf_llama" (HF's
    loss from ``labels``), "hf_mixtral" (HF's experts layers, token-local), "hf_llama_left_padding"
    (a padding ``attention_mask``, each row padded differently, across shard boundaries), and
    "llama" on a ``dp`` x sp mesh (each replica its own slice of a global batch, the gradients
    averaged over the replicas by autosp as DDP does, against one device averaging the slices'
    losses)."""
    import hf_models

    torch.manual_seed(0)
    if family == "llama":
        model, vocab = MODELS["llama"](), 256
    else:
        arch = family.removeprefix("hf_").removesuffix("_left_padding")
        model = (hf_models.build if arch in hf_models.configs() else hf_models.build_generic)(arch, "sdpa")
        vocab = 128
    ref = copy.deepcopy(model)

    def inputs(L: int) -> list[dict]:
        """Each dp replica's keyword arguments at length L."""
        g = torch.Generator().manual_seed(L)
        ids = torch.randint(0, vocab, (dp, L), generator=g)
        labels = ids.clone()
        labels[:, : L // 4] = -100
        kw = {"input_ids": ids, "labels": labels}
        if family.endswith("_left_padding"):
            pad = L // 3  # rank 0's rows all padding, rank 1's from the middle of the sequence
            kw["attention_mask"] = torch.ones_like(ids).index_fill_(1, torch.arange(pad), 0)
            labels[:, :pad] = -100
        return [{k: v[r : r + 1] for k, v in kw.items()} for r in range(dp)]

    def loss_of(m, **kw):
        if family == "llama":
            return m(kw["input_ids"], kw["labels"])
        return m(**kw).loss

    steps, before = [], _compiles()
    with autosp.mesh(dp=dp) as mesh:
        step = autosp.shard(lambda **kw: loss_of(model, **kw), compiler="inductor", dynamic=True)
        for L in lengths:
            for p in [*model.parameters(), *ref.parameters()]:
                p.grad = None
            mine = inputs(L)[mesh.dp_rank]
            loss = step(**mine)
            loss.backward()
            losses = [loss_of(ref, **kw) for kw in inputs(L)]
            (sum(losses) / dp).backward()
            steps.append((loss.item(), losses[mesh.dp_rank].item(), max(_grad_errors(model, ref).values())))
        flops = (_matmul_flops(lambda: step(**mine)), _matmul_flops(lambda: loss_of(ref, **mine)))
    return {
        "steps": steps,
        "graphs": _compiles() - before,
        "kinds": sorted({c.kind for c in step.plan.collectives}),
        "flops": flops,
    }


_GPU_KERNELS = tuple(f"aten::_scaled_dot_product_{k}_attention" for k in ("flash", "efficient", "cudnn"))


def _gpu_kernel_queries(prof) -> list[tuple]:
    """(kernel event, query shape) of each CUDA attention forward a profile saw."""
    return sorted({(e.name, tuple(e.input_shapes[0])) for e in prof.events() if e.name in _GPU_KERNELS})


def gpu_kernel_exactness(
    kind: str,
    b: int,
    L: int,
    attention: str = "auto",
    ulysses: int | None = None,
    compiler: str = "aot_eager",
    dynamic: bool | None = None,
    kernel: str | None = "flash",
) -> dict:
    """A step captured with a CUDA attention kernel (``kernel``, or None: the one SDPA picks on the
    GPU for fp32, memory-efficient), the graph ``autosp.explain(device=...)`` plans, run by the
    kernel's CPU reference (``cuda_reference``): loss and gradients against one device running
    the same kernel, this rank's matmul FLOPs against one device's, the (kernel, query shape)
    pairs it ran on here (torch.profiler's, inside ring attention's op too), the plan's
    collectives and notes."""
    import cuda_reference  # noqa: F401  registers the CPU reference kernels

    from autosp._attention_ops import gpu_attention

    torch.manual_seed(0)
    model = MODELS[kind]()
    ref = copy.deepcopy(model)
    ids, labels = batch(kind, b, L, seed=0)
    with gpu_attention(kernel), autosp.mesh(ulysses=ulysses):
        step = autosp.shard(
            lambda input_ids, labels: model(input_ids, labels),
            compiler=compiler,
            attention=attention,
            **({} if dynamic is None else {"dynamic": dynamic}),
        )
        loss = step(ids, labels)
        loss.backward()
        loss_ref = ref(ids, labels)
        loss_ref.backward()
        grad_err = {n: _rel(p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())}
        with torch.profiler.profile(record_shapes=True) as prof:
            step(ids, labels)
        flops = (_matmul_flops(lambda: step(ids, labels)), _matmul_flops(lambda: ref(ids, labels)))
    return dict(
        loss=(loss.item(), loss_ref.item()),
        grad_err=grad_err,
        flops=flops,
        queries=_gpu_kernel_queries(prof),
        kinds=sorted({c.kind for c in step.plan.collectives}),
        notes=list(step.plan.notes),
    )


def flex_exactness(
    mask: str,
    lengths: list[int],
    score: str = "none",
    attention: str = "auto",
    compiler: str = "aot_eager",
    dynamic: bool | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    b: int = 1,
    device: str = "cpu",
    lse: bool = False,
) -> dict:
    """A Llama with FlexAttention (``flex_models``) and the block mask ``mask`` built outside the
    step, ``b`` sequences a step at each of ``lengths`` (on ``device``; a GPU's block size is 128):
    loss and gradients against one device, this rank's matmul FLOPs against one device's and the
    most rows of any (..., rows, L) tensor read on this rank (an L x L mask has L) at the last
    length, the plan's collectives (kind, from, to, rank of the shape), notes and compiles."""
    import flex_models
    from flex_models import FlexLlama, block_mask, documents

    torch.manual_seed(0)
    model = FlexLlama(LlamaConfig(heads=heads, kv_heads=kv_heads), score=score, lse=lse).to(device)
    ref = copy.deepcopy(model)
    block = 128 if device == "cuda" else flex_models.BLOCK
    steps, graphs = [], 0
    with autosp.mesh():
        step = autosp.shard(
            lambda input_ids, labels, block_mask: model(input_ids, labels, block_mask),
            compiler=compiler,
            attention=attention,
            **({} if dynamic is None else {"dynamic": dynamic}),
        )
        for L in lengths:
            ids, labels = (t.to(device) for t in batch("llama", b, L, seed=L))
            bm = block_mask(mask, L, documents(L, rows=b), heads, block, device)
            compiled = _compiles()
            loss = step(ids, labels, bm)
            loss.backward()
            graphs += _compiles() - compiled  # the sharded step's (torch's eager FlexAttention compiles its own)
            loss_ref = ref(ids, labels, bm)
            loss_ref.backward()
            err = max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
            steps.append((loss.item(), loss_ref.item(), err))
            model.zero_grad(), ref.zero_grad()
        rows = _square_rows(lambda: step(ids, labels, bm), L)
        flops = (_matmul_flops(lambda: step(ids, labels, bm)), _matmul_flops(lambda: ref(ids, labels, bm)))
    return dict(
        steps=steps,
        flops=flops,
        rows=rows,
        graphs=graphs,
        kinds=sorted({(c.kind, c.src, c.dst, len(c.shape)) for c in step.plan.collectives}),
        notes=list(step.plan.notes),
    )
