"""The graph a GPU runs: attention captured as the CUDA kernel SDPA picks there (flash, or
memory-efficient for fp32 and masks; ``autosp.explain(device=...)``), planned on a fake process
group like any other graph, and run exact on gloo through the kernels' CPU references
(``cuda_reference``)."""

from __future__ import annotations

import math
from collections import Counter

import cases
import pytest
import torch
import torch.nn.functional as F
from _checks import tier
from test_plan import _ulysses_expected

import autosp
from autosp._attention_ops import CUDA_FLASH, CUDNN, EFFICIENT, gpu_attention, gpu_kernel
from examples.models import Llama, LlamaConfig

L, LAYERS = 96, 2
FLASH_NOTE = "attention kernel: CUDA flash"
EFFICIENT_NOTE = "attention kernel: CUDA memory-efficient"
NOTES = {"flash": FLASH_NOTE, "efficient": EFFICIENT_NOTE, "cudnn": "attention kernel: CUDA cuDNN"}


def _llama_plan(world, heads, kv, dim, attn="sdpa", device="h100", dynamic=False, attention="auto"):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=heads, kv_heads=kv, dim=dim, layers=LAYERS, attn=attn)).to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, L))
    with autosp.mesh(sp=world):
        step = autosp.shard(
            lambda input_ids, labels: model(input_ids, labels),
            compiler="aot_eager",
            dynamic=dynamic,
            attention=attention,
        )
        return model, autosp.explain(step, ids, ids, device=device)


def _flash_ops(plan) -> set[str]:
    return {c.op for c in plan.collectives if "flash" in c.op}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("world,heads,kv,dim", tier([(2, 4, 2, 64), (4, 8, 4, 64), (8, 16, 8, 128)], [(4, 8, 4, 64)]))
def test_gpu_plan_runs_cuda_flash_with_exactly_ulysses_collectives(fake_world, world, heads, kv, dim, dynamic):
    """Planned for an H100 (bf16), attention is CUDA's flash kernel, forward and backward, and the
    plan is hand-written Ulysses' collectives and nothing else: catches the CUDA kernel falling to
    a generic strategy (heads or batch only, an all-gather of Q/K/V), and ``explain`` not naming
    the kernel it planned for."""
    fake_world(world)
    model, plan = _llama_plan(world, heads, kv, dim, dynamic=dynamic)
    got = Counter((c.kind, c.backward, math.prod(c.shape)) for c in plan.collectives)
    assert got == _ulysses_expected(model, world, heads, kv, dim), str(plan)
    assert any(n.startswith(FLASH_NOTE) for n in plan.notes), plan.notes
    assert {"aten._scaled_dot_product_flash_attention.default"} <= {c.op for c in plan.collectives}, str(plan)
    assert plan.activation_bytes == pytest.approx(plan.ulysses_bytes)


def test_gpu_plan_runs_cuda_flash_as_a_ring_where_heads_do_not_split(fake_world):
    """2 query / 1 K/V heads (grouped inside the kernel, ``enable_gqa``) on 4 ranks: the heads
    cannot split, so CUDA flash runs as ring attention (its blocks run by the flash kernel), the
    query sequence-sharded; no activation all-gathered; ``kv_gather`` forced gathers K/V."""
    fake_world(4)
    _, plan = _llama_plan(4, 2, 1, 64, attn="gqa")
    assert plan.count("ring") == 4 and plan.count("all_gather") == 0, str(plan)
    assert _flash_ops(plan) == {
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_backward.default",
    }
    assert any("ring attention" in n for n in plan.notes), plan.notes
    _, forced = _llama_plan(4, 2, 1, 64, attn="gqa", attention="kv_gather")
    assert forced.count("ring") == 0 and forced.count("all_gather") > 0, str(forced)


def test_gpu_kernel_is_the_one_sdpa_picks_for_the_dtype(fake_world):
    """bf16 and fp16 without a mask run as flash on the GPU; fp32, a mask, or a causal mask over
    fewer queries than keys, as memory-efficient; a head dim or grouped K/V the memory-efficient
    kernel does not take, as SDPA's math fallback (None: planned op by op); a forced kernel that
    cannot run, an unknown kernel or device, and AMD's (whose kernels differ): clear errors, not a
    plan for another kernel."""
    assert gpu_kernel(torch.bfloat16, False, 128) is CUDA_FLASH
    assert gpu_kernel(torch.bfloat16, True, 128) is EFFICIENT
    assert gpu_kernel(torch.float32, False, 64) is EFFICIENT
    assert gpu_kernel(torch.float32, False, 64, forced="flash") is CUDA_FLASH
    assert gpu_kernel(torch.bfloat16, False, 12) is CUDA_FLASH  # SDPA pads the head dim for flash
    assert gpu_kernel(torch.bfloat16, False, 64, square=False) is EFFICIENT  # causal, fewer queries than keys
    assert gpu_kernel(torch.float32, False, 12) is EFFICIENT
    assert gpu_kernel(torch.float32, False, 6) is None  # SDPA's math fallback, planned op by op
    assert gpu_kernel(torch.float32, False, 64, grouped=True) is None
    assert gpu_kernel(torch.bfloat16, False, 64, grouped=True) is CUDA_FLASH
    with pytest.raises(NotImplementedError, match="grouped K/V heads"):
        gpu_kernel(torch.float32, False, 64, forced="efficient", grouped=True)
    assert gpu_kernel(torch.bfloat16, False, 64, forced="cudnn") is CUDNN
    with pytest.raises(ValueError, match="attention_kernel='fa3'"):
        gpu_kernel(torch.bfloat16, False, 64, forced="fa3")
    fake_world(2)
    with pytest.raises(ValueError, match="no device 'v100'"):
        _llama_plan(2, 4, 2, 64, device="v100")
    with pytest.raises(NotImplementedError, match="kernels recorded are NVIDIA's"):
        _llama_plan(2, 4, 2, 64, device="mi300x")


def test_fp32_plans_the_memory_efficient_kernel_with_ulysses_collectives(fake_world):
    """In fp32 SDPA runs the memory-efficient kernel on the GPU (its log-sum-exp padded to 32
    rows): the plan is still exactly Ulysses' collectives, and names that kernel."""
    fake_world(4)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=8, kv_heads=4, dim=64, layers=LAYERS))
    ids = torch.randint(0, 256, (1, L))
    with autosp.mesh(sp=4):
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")
        plan = autosp.explain(step, ids, ids, device="h100")
    got = Counter((c.kind, c.backward, math.prod(c.shape)) for c in plan.collectives)
    assert got == _ulysses_expected(model, 4, 8, 4, 64), str(plan)
    assert any(n.startswith(EFFICIENT_NOTE) for n in plan.notes), plan.notes


def test_cuda_flash_dropout_is_refused(fake_world):
    """CUDA flash draws its own dropout mask: split over the ranks each would draw another mask
    than the single device's, so attention dropout under it is an error naming the op."""
    fake_world(2)
    q = torch.randn(1, 4, 32, 16, dtype=torch.bfloat16, requires_grad=True)

    def step(x):
        return F.scaled_dot_product_attention(x, x, x, dropout_p=0.1, is_causal=True).float().sum()

    with autosp.mesh(sp=2):
        sharded = autosp.shard(step, compiler="aot_eager", seq={"x": 2})
        with pytest.raises(autosp.PlanError, match="draws its own mask"):
            autosp.explain(sharded, q, device="h100")


HF_ARCHS = ["llama", "qwen2", "mistral"]


def _hf_plan(arch, world, device=None, attention="auto"):
    from hf_models import build

    model = build(arch, "sdpa").to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 64))
    with autosp.mesh(sp=world):
        step = autosp.shard(
            lambda input_ids, labels: model(input_ids=input_ids, labels=labels).loss,
            compiler="aot_eager",
            attention=attention,
        )
        return autosp.explain(step, ids, ids, device=device)


def _collectives(plan) -> Counter:
    return Counter((c.kind, c.backward, c.shape) for c in plan.collectives)


@pytest.mark.parametrize("arch", HF_ARCHS)
@pytest.mark.parametrize("world", tier([2, 4, 8], [4]))
def test_hf_models_plan_cuda_kernels_as_the_cpu_kernel(fake_world, arch, world):
    """HF Llama, Qwen2 and Mistral (4 query / 2 K/V heads, HF's SDPA path) planned for an H100.
    Under torch.compile HF passes a causal mask, so attention is the memory-efficient kernel with
    the mask as its bias: the plan is the CPU kernel's, collective for collective and shape for
    shape (ring attention, the bias split by query rows, where Ulysses would hold the whole (L, L)
    mask on every rank), with no activation all-gathered. The memory-efficient kernel takes no
    grouped K/V, yet HF's repeated K/V are folded as for the CPU kernel and repeated on each rank
    after the collectives: the ring passes the 2 K/V heads, not 4. With Ulysses forced, activation
    bytes are at most a hand-written Ulysses plan's where the 4 query heads split (K/V replicated
    where the 2 K/V heads do not split over 4 ranks, as ALST replicates them)."""
    fake_world(world)
    gpu, cpu = _hf_plan(arch, world, "h100"), _hf_plan(arch, world)
    assert any(n.startswith(EFFICIENT_NOTE) for n in gpu.notes), gpu.notes
    assert gpu.count("all_gather") == 0 and gpu.count("ring") > 0, str(gpu)
    assert _collectives(gpu) == _collectives(cpu), str(gpu)
    if world > 4:  # 4 query heads cannot split over 8 ranks
        return
    forced = _hf_plan(arch, world, "h100", "ulysses")
    assert forced.count("all_gather") == 0, str(forced)
    assert forced.activation_bytes <= forced.ulysses_bytes * (1 + 1e-9), str(forced)


# (model, batch, length, ranks, attention, ulysses, kernel): Ulysses; grouped K/V inside the
# kernel; a ring where 2 heads do not split over 4 ranks, and K/V gathered; hybrid on a 2D mesh;
# the memory-efficient kernel (fp32's) and cuDNN's (forced) as Ulysses and as a ring
EXACT = [
    ("llama", 2, 96, 2, "auto", None, "flash"),
    ("llama_gqa", 2, 96, 2, "auto", None, "flash"),
    ("llama_2h", 1, 96, 4, "auto", None, "flash"),
    ("llama_2h", 1, 93, 4, "kv_gather", None, "flash"),
    ("llama", 2, 96, 4, "hybrid", 2, "flash"),
    ("llama", 2, 96, 2, "auto", None, None),
    ("llama_2h", 1, 93, 4, "auto", None, None),
    ("llama", 2, 96, 2, "auto", None, "cudnn"),
    ("llama_2h", 1, 96, 4, "auto", None, "cudnn"),
]


@pytest.mark.parametrize(
    "kind,b,length,world,attention,ulysses,kernel", tier(EXACT, [EXACT[0], EXACT[2], EXACT[6], EXACT[8]])
)
def test_cuda_kernel_steps_match_single_device(pools, kind, b, length, world, attention, ulysses, kernel):
    """A step captured with a CUDA attention kernel, run on gloo ranks through the kernel's CPU
    reference: loss and gradients as one device running the same kernel (fp32, 1e-5), the work
    split (matmul FLOPs per rank <= 1.25 / N of one device's; the kernel ran on this rank's heads
    or query rows only) and the collectives the plan names."""
    args = (kind, b, length, attention, ulysses, "aot_eager", None, kernel)
    for r in pools(world).run(cases.gpu_kernel_exactness, *args):
        loss, loss_ref = r["loss"]
        assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        assert r["flops"][0] <= 1.25 / world * r["flops"][1], r["flops"]
        name = {"flash": "flash", None: "efficient", "cudnn": "cudnn"}[kernel]
        assert any(n.startswith(NOTES[name]) for n in r["notes"]), r["notes"]
        heads = {"llama_2h": 2}.get(kind, 4)
        event = f"aten::_scaled_dot_product_{name}_attention"
        assert r["queries"] and {name for name, _ in r["queries"]} == {event}, r["queries"]
        assert all(q[1] * q[2] <= heads * length / world + heads for _, q in r["queries"]), r["queries"]
        # Ulysses where the heads split, else a ring; what is forced
        expected = {"auto": "ring" if kind == "llama_2h" else "all_to_all", "kv_gather": "all_gather"}
        assert expected.get(attention, attention) in r["kinds"], r["kinds"]
        assert attention == "kv_gather" or "all_gather" not in r["kinds"], r["kinds"]


@pytest.mark.parametrize("arch", tier(HF_ARCHS, ["llama"]))
@pytest.mark.parametrize("world", tier([2, 4], [2]))
def test_hf_models_through_cuda_kernels_match_single_device(pools, arch, world):
    """HF Llama, Qwen2 and Mistral through the kernel SDPA picks on the GPU (memory-efficient, with
    HF's causal mask as its bias; its K/V repeats folded and done on each rank), run by its CPU
    reference on gloo ranks: loss and gradients as one device's (fp32, 1e-5), matmul FLOPs per
    rank <= 1.25 / N, and no rank holding more than its query rows of the (L, L) mask."""
    for r in pools(world).run(cases.gpu_kernel_hf_exactness, arch, 2, 64):
        loss, loss_ref = r["loss"]
        assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        assert r["flops"][0] <= 1.25 / world * r["flops"][1], r["flops"]
        assert {name for name, _ in r["gpu_kernels"]} == {"aten::_scaled_dot_product_efficient_attention"}
        assert any(n.startswith(EFFICIENT_NOTE) for n in r["notes"]), r["notes"]
        # where the 2 K/V heads split over the ranks, HF's repeated K/V move unrepeated, repeated on
        # each rank before the kernel (``call_grouped``)
        folded = any("repeated on each rank just before" in n for n in r["notes"])
        assert folded == (world == 2), r["notes"]
        assert r["square_rows"] <= 64 // world, r["square_rows"]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
def test_cuda_kernel_steps_match_single_device_under_inductor_and_symbolic_lengths(pools, kernel):
    """The defaults: Inductor and symbolic lengths, with attention as each CUDA kernel (Inductor
    plans with the meta function's strides, which the CPU references keep)."""
    for r in pools(2).run(cases.gpu_kernel_exactness, "llama", 2, 96, "auto", None, "inductor", True, kernel):
        assert r["kinds"] == ["all_reduce", "all_to_all"], r["kinds"]
        assert {name for name, _ in r["queries"]} == {f"aten::_scaled_dot_product_{kernel}_attention"}, r["queries"]
        loss, loss_ref = r["loss"]
        assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
        assert max(r["grad_err"].values()) <= 1e-5, r["grad_err"]


def test_gpu_attention_routes_sdpa_to_the_kernel_and_the_reference_matches_sdpa():
    """Under ``gpu_attention``, SDPA's autograd graph is the CUDA flash kernel's; its CPU reference
    gives SDPA's output and gradients (grouped K/V included): what the gloo tests above rely on."""
    import cuda_reference  # noqa: F401

    torch.manual_seed(0)
    q = torch.randn(2, 4, 10, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 10, 8, requires_grad=True) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with gpu_attention("flash"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionBackward0"
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(ref.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_memory_efficient_reference_pads_its_log_sum_exp_and_takes_a_mask_as_sdpa_does():
    """The memory-efficient kernel's CPU reference: its log-sum-exp padded to 32 rows (as CUDA's),
    its output in the meta's (B, L, H, D) layout, and a bool mask converted to a bias as SDPA
    converts it: output and gradients as SDPA's with the mask, at 40 tokens (padded to 64)."""
    import cuda_reference  # noqa: F401

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 40, 40) > 0.3
    mask |= torch.eye(40, dtype=torch.bool)  # every row sees a key
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with gpu_attention("efficient"):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert type(out.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
    torch.testing.assert_close(out, ref)
    for a, b in zip(
        torch.autograd.grad(out.square().sum(), (q, k, v)), torch.autograd.grad(ref.square().sum(), (q, k, v))
    ):
        torch.testing.assert_close(a, b)
    bias = torch.zeros(2, 1, 40, 40).masked_fill(~mask, float("-inf"))
    o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False)
    assert lse.shape == (2, 4, 64) and o.transpose(1, 2).is_contiguous()


def test_plan_cli_traces_attention_as_the_devices_kernel(fake_world):
    """``autosp plan --device h100`` plans the graph that GPU runs: its traces name CUDA's kernel
    (the CLI's HF model passes no mask at a plan's lengths: flash in bf16)."""
    from hf_models import TINY_HF

    from autosp._cli import trace_plan

    fake_world(4)
    plan = trace_plan(TINY_HF, layers=1, seq=256, batch=1, sp=4, dtype=torch.bfloat16, device="h100")
    assert any(n.startswith(FLASH_NOTE) for n in plan.notes), plan.notes
    assert plan.count("all_gather") == 0, str(plan)
    # its 4 query / 2 K/V heads reach SDPA grouped (enable_gqa), which the memory-efficient kernel
    # does not take: forced, a clear error (not a graph break)
    with pytest.raises(NotImplementedError, match="grouped K/V heads"):
        trace_plan(TINY_HF, layers=1, seq=256, batch=1, sp=4, dtype=torch.bfloat16, attention_kernel="efficient")


def test_device_figures_weigh_the_checkpointing_costs(fake_world):
    """Planned for an H100, the checkpointing pass weighs a byte written at the H100's balance (295
    flop/B, not this CPU's 16) and an offloaded byte at its host link's (15,450 flop/B): the same
    rungs (the thresholds' named by their cost per byte), their offloaded twins' copies far dearer
    against the step. Catches a plan for a GPU that
    prices host copies as RAM-to-RAM copies (a CPU's), which makes offload look nearly free."""
    from autosp.partition import Balance

    h100 = Balance.of("h100")
    assert h100.written == pytest.approx(989e12 / 3.35e12) and h100.copied == pytest.approx(989e12 / 64e9)
    fake_world(2)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=4, kv_heads=2, dim=64, layers=LAYERS)).to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, L))
    rungs = {}
    with autosp.mesh(sp=2):
        step = autosp.shard(
            lambda input_ids, labels: model(input_ids, labels),
            compiler="aot_eager",
            checkpoint="full",
            every_rung=True,
            offload=True,
        )
        for device in (None, "h100"):  # the same graph (CUDA's flash kernel), weighed at two machines' figures
            plan = autosp.explain(step, ids, ids, device=device, attention_kernel="flash")
            rungs[device] = {r.name: r for r in plan.checkpoint.rungs}
    # the same rungs but the thresholds', which are named by their cost per byte
    assert {k for k in rungs[None] if "flop/B" not in k} == {k for k in rungs["h100"] if "flop/B" not in k}
    cpu, gpu = rungs[None]["full, offloaded"], rungs["h100"]["full, offloaded"]
    assert cpu.copied == 16.0 and gpu.copied == h100.copied
    assert cpu.memory.host == gpu.memory.host > 0
    assert gpu.copies > 20 * cpu.copies, (gpu.copies, cpu.copies)
