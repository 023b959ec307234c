"""A world of one (``python train.py`` on one device, no torchrun): the step runs autosp's passes as
on a larger mesh (checkpointing, tiling, host offload), its sp group's collectives removed from
the per-rank graph, and means what it means on one device."""

import functools

import cases
import pytest
import torch
from _checks import tier

import autosp
from examples.models import Llama, LlamaConfig


@pytest.mark.parametrize(
    "kind,b,L",
    tier(
        [("llama", 2, 96), ("gpt", 2, 48), ("llama_manual", 1, 96), ("llama_6h", 2, 96), ("llama_gqa", 2, 96)],
        [("llama", 2, 96), ("gpt", 2, 48)],
    ),
)
def test_world_of_one_trajectory_matches_single_device_fp64(pools, kind, b, L):
    """Planned (not plain ``torch.compile``), no collective in the plan, and the gradients and
    the parameters after 3 AdamW steps equal one device's in fp64. (The loss is compared at
    1e-6: these models cast the logits ``.float()``, so the loss is an fp32 sum, which autosp's
    decomposed cross-entropy adds in another order: 8.4e-8 relative measured.)"""
    r = pools(1).run(cases.exactness, kind, b, L, 3, "aot_eager", torch.float64)[0]
    assert r["planned"] and r["kinds"] == [], r
    loss, loss_ref = r["loss"]
    assert abs(loss - loss_ref) <= 1e-6 * abs(loss_ref)
    assert max(r["grad_err"].values()) <= 1e-10 and r["param_err"] <= 1e-10, r


def test_world_of_one_runs_no_collective_and_no_more_work(pools):
    """Counted by torch.profiler: no gloo collective runs in a step; its FLOPs are one device's
    within 0.1% (the "auto" rung at this length recomputes nothing; measured +0.05%, the
    profiler's count of elementwise ops that differ: the decomposed cross-entropy's), and it
    saves no more bytes for the backward than one device but the decomposed cross-entropy's mask
    of the labels it counts (one bool a token, 192 bytes here; torch's fused ``nll_loss`` keeps
    none)."""
    b, L = 2, 96
    r = pools(1).run(cases.world_of_one_work, "llama", b, L)[0]
    assert r["planned"] and r["rows"] == 0 and r["gloo"] == [], r
    flops, single = r["flops"]
    assert single <= flops <= 1.001 * single, r
    saved, single_saved = r["saved"]
    assert saved <= single_saved + b * L, r


def test_world_of_one_checkpoints_tiles_and_offloads_exact(pools):
    """The rung with the least memory at one rank, "full + loss" in tiles with the layers' saved
    activations in host memory, forced (tiles from 8 rows): 2 AdamW steps exact in fp64."""
    args = ("llama", 2, 96, 2, "aot_eager", torch.float64, "cpu", "full", "auto", None, True, False)
    r = pools(1).run(cases.tiled, cases.exactness, *args)[0]
    assert r["checkpoint"].endswith(", offloaded") and " tiles" in r["checkpoint"] and r["host"] > 0, r
    assert max(r["grad_err"].values()) <= 1e-10 and r["param_err"] <= 1e-10, r


@pytest.mark.slow
def test_world_of_one_under_the_defaults(pools):
    """Inductor and a symbolic length, the logits in tiles sized by memory ("full + loss", tiles
    from 2 rows): fp32 within 1e-5."""
    args = ("llama_vocab", 2, 96, 1, "inductor", torch.float32, "cpu", "full", "auto", None, False, True)
    r = pools(1).run(functools.partial(cases.tiled, min_rows=2), cases.exactness, *args)[0]
    assert " tiles" in r["checkpoint"] and r["kinds"] == [], r
    loss, loss_ref = r["loss"]
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
    assert max(r["grad_err"].values()) <= 1e-5, r


@pytest.mark.parametrize("attention", ["ring", "hybrid"])
def test_a_forced_attention_kernel_runs_whole_at_one_rank(fake_world, attention):
    """A config that forces an attention kernel for the larger mesh runs at one rank too: there
    every kernel is attention run whole, so none is forced (before, a forced ring was a PlanError
    at one rank, the ring's strategies not being offered there); the plan has no collective."""
    fake_world(1)
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    ids = torch.randint(0, 256, (1, 64))
    with autosp.mesh(sp=1):
        step = autosp.shard(lambda a, b: model(a, b), compiler="aot_eager", dynamic=False, attention=attention)
        plan = autosp.explain(step, ids, ids)
    assert plan.collectives == () and plan.checkpoint is not None, plan
