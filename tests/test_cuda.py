"""The exactness contract on CUDA: a world of one on one GPU, one rank of a larger job on one GPU
(collectives on a fake process group), and NCCL across GPUs. Marked ``cuda``; skipped where CUDA
is absent. ``scripts/gpu_ci.sh`` runs them."""

from __future__ import annotations

import math
from collections import Counter

import cases
import pytest
import torch
import torch.distributed as dist
from test_exact import MODELS
from test_plan import CONFIGS, LAYERS, _ulysses_expected
from test_plan import L as PLAN_L

import autosp
from examples.models import Llama, LlamaConfig

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="needs CUDA: torch.cuda.is_available() is False")]


def needs_gpus(n: int):
    return pytest.mark.skipif(n > GPUS, reason=f"needs {n} GPUs for NCCL, found {GPUS}")


@pytest.fixture
def fp32():
    """fp32 matmuls and convolutions in fp32: the tests compare at 1e-5 relative, which TF32's
    10-bit mantissa cannot meet."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def own_world():
    """No process group before the test (autosp.mesh() makes its own), none after."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    torch._dynamo.reset()


def _assert_exact(r: dict, tol: float = 1e-5) -> None:
    loss, loss_ref = r["loss"]
    assert abs(loss - loss_ref) <= tol * abs(loss_ref), r["loss"]
    worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
    assert worst[1] <= tol, worst


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind,b,L", [m for m in MODELS if m[0] != "llama_manual"])
def test_world_of_one_on_gpu_matches_eager(fp32, own_world, kind, b, L, compiler):
    """`python train.py` on a GPU machine: autosp.mesh() makes an NCCL world of one and the step
    compiles to Triton kernels (Inductor) or runs aot_eager; loss and grads equal plain eager on
    the same GPU. Catches a tensor made on the CPU inside the step, a mesh on the wrong device,
    and a wrong compile path at sp=1."""
    r = cases.exactness(kind, b, L, 1, compiler, device="cuda")
    assert dist.get_backend() == "nccl"
    _assert_exact(r)


def _cuda_llama(heads: int, kv: int, dim: int, attn: str) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(heads=heads, kv_heads=kv, dim=dim, layers=LAYERS, attn=attn)).cuda()


@pytest.mark.parametrize("attn", ["sdpa", "manual"])
def test_rank_local_plan_is_ulysses_and_step_runs_on_gpu(fake_world, attn):
    """One rank of a 4-rank job on one GPU (fake process group): the plan is exactly the CPU
    plan's Ulysses all-to-alls and all-reduces, attention planned as the CUDA kernel SDPA picked
    (its record in ``autosp._attention_ops``: a gather here means it fell to DTensor's
    strategies), and the compiled step runs with every tensor on the GPU."""
    world, heads, kv, dim = CONFIGS[1]
    fake_world(world)
    model = _cuda_llama(heads, kv, dim, attn)
    ids = torch.randint(0, 256, (1, PLAN_L), device="cuda")
    with autosp.mesh(sp=world):
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")
        plan = autosp.explain(step, ids, ids)
        got = Counter((c.kind, c.backward, math.prod(c.shape)) for c in plan.collectives)
        assert got == _ulysses_expected(model, world, heads, kv, dim), str(plan)
        # fp32 on an sm80+ GPU: SDPA's memory-efficient kernel, planned by its record
        assert attn != "sdpa" or any(n.startswith("attention kernel: CUDA") for n in plan.notes), plan.notes
        loss = step(ids, ids)
        loss.backward()
    assert loss.device.type == "cuda"
    assert all(p.grad is not None and p.grad.device.type == "cuda" for p in model.parameters())


def _step_peak(fn) -> int:
    """Peak bytes allocated during one step above what a warm-up step leaves held (parameters and
    gradients): the step's activations, temporaries and communication buffers."""
    fn().backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_rank_local_peak_memory_is_below_single_device(fake_world):
    """The point of SP, on a GPU: one rank of a 4-rank job at 8192 tokens holds less at its peak
    than one device running the whole sequence (same model, same compiler)."""
    world, heads, kv, dim = CONFIGS[1]
    model = _cuda_llama(heads, kv, dim, "sdpa")
    ids = torch.randint(0, 256, (1, 8192), device="cuda")
    single = torch.compile(lambda input_ids, labels: model(input_ids, labels), backend="aot_eager", fullgraph=True)
    single_peak = _step_peak(lambda: single(ids, ids))
    fake_world(world)
    with autosp.mesh(sp=world):
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager")
        sharded_peak = _step_peak(lambda: step(ids, ids))
    assert sharded_peak < single_peak, (sharded_peak, single_peak)


NCCL_CASES = (
    [pytest.param(2, *m, "aot_eager", marks=needs_gpus(2)) for m in MODELS]
    + [
        pytest.param(2, "llama", 2, 93, "aot_eager", marks=needs_gpus(2)),  # uneven shards
        pytest.param(2, "llama", 2, 96, "inductor", marks=needs_gpus(2)),
    ]
    + [pytest.param(4, *m, "aot_eager", marks=needs_gpus(4)) for m in MODELS]
)


@pytest.mark.parametrize("world,kind,b,L,compiler", NCCL_CASES)
def test_nccl_loss_and_grads_match_single_device_fp32(nccl_pools, world, kind, b, L, compiler):
    """test_exact's contract over NCCL, one GPU per rank: the global loss on every rank and every
    gradient equal one device's (the same GPU, in each worker) within 1e-5 relative."""
    for r in nccl_pools(world).run(cases.exactness, kind, b, L, 1, compiler, torch.float32, "cuda"):
        _assert_exact(r)
        assert r["planned"]


@pytest.mark.parametrize("attention,L", [("auto", 512), ("kv_gather", 512), ("kv_gather", 500)])
def test_rank_local_flex_attention_lowers_to_triton_and_runs_on_gpu(fake_world, attention, L):
    """FlexAttention (3 packed documents, ALiBi) as rank 0 of a 2-rank job on one GPU, under
    Inductor: the per-rank op (Ulysses; or its rows, 256 whole blocks at 512 tokens, 250 rows
    ending mid-block at 500) lowers to Triton and runs, every tensor on the GPU. The CPU suite
    cannot lower its backward; the values are checked by the test below and over NCCL."""
    from flex_models import FlexLlama, block_mask, documents

    fake_world(2)
    torch.manual_seed(0)
    model = FlexLlama(LlamaConfig(layers=LAYERS), score="alibi").cuda()
    ids = torch.randint(0, 256, (1, L), device="cuda")
    mask = block_mask("documents", L, documents(L), block=128, device="cuda")
    with autosp.mesh(sp=2):
        step = autosp.shard(lambda i, labels, m: model(i, labels, m), compiler="inductor", attention=attention)
        loss = step(ids, ids, mask)
        loss.backward()
    assert loss.device.type == "cuda" and torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.device.type == "cuda" for p in model.parameters())


@needs_gpus(2)
@pytest.mark.parametrize("attention", ["auto", "kv_gather"])
def test_nccl_flex_attention_matches_single_device_under_inductor(fp32, nccl_pools, attention):
    """FlexAttention over NCCL under Inductor (Triton's flex kernels): packed documents with ALiBi
    at 512 then 500 tokens, exact against one GPU running the model eagerly (fp32, 1e-5)."""
    results = nccl_pools(2).run(
        cases.flex_exactness, "documents", [512, 500], "alibi", attention, "inductor", True, 4, 2, 1, "cuda"
    )
    for r in results:
        for loss, ref, err in r["steps"]:
            assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, r["steps"]


@pytest.mark.parametrize("start,rows", [(256, 256), (250, 250), (0, 250)])
def test_a_ranks_flex_rows_match_the_whole_sequence_under_triton(fp32, start, rows):
    """A rank's rows of FlexAttention through its own block mask (``rows_block_mask``: sliced
    where its first row starts a 128-row block, else every block partial) and offset mask
    function, compiled to Triton, forward and backward: the whole sequence's output at those
    rows, and the query, key and value gradients of a loss on those rows."""
    from flex_models import block_mask, documents
    from test_flex import _rank_mask
    from torch.nn.attention.flex_attention import flex_attention

    S, H, D = 512, 4, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", requires_grad=True) for _ in range(3))
    g = torch.randn(1, H, rows, D, device="cuda")
    whole = block_mask("documents", S, documents(S), block=128, device="cuda")
    compiled = torch.compile(flex_attention)
    want = compiled(q, k, v, block_mask=whole)[:, :, start : start + rows]
    dq, dk, dv = torch.autograd.grad((want * g).sum(), (q, k, v))
    _, mine, _ = _rank_mask(whole, start, rows, block=128)
    qr = q.detach()[:, :, start : start + rows].requires_grad_()
    got = compiled(qr, k, v, block_mask=mine)
    gq, gk, gv = torch.autograd.grad((got * g).sum(), (qr, k, v))
    for a, b in ((got, want), (gq, dq[:, :, start : start + rows]), (gk, dk), (gv, dv)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (start, rows)
