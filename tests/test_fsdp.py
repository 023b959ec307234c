"""FSDP2 (``fully_shard``) composed with ``autosp.shard`` on 4 ranks: parameters, gradients and
AdamW state sharded (ZeRO-3), the step exact against one device (fp64: AdamW's first step
divides each gradient element by its own magnitude, so fp32 roundoff in near-zero elements would
move them by up to lr in either run), and the parameter gathers gloo ran: one per parameter in
the forward and, where the module reshards after forward, again in the backward where the
backward reads it."""

import cases
import pytest
import torch


@pytest.mark.parametrize(
    "kind,b,L,dp,over,reshard,as_module,offload",
    [
        # sharded over dp, sp over sp
        pytest.param("llama", 4, 64, 2, "dp", True, False, False, marks=pytest.mark.slow),
        # the autosp mesh: sharded over sp, replicated over dp; autosp.shard(model); FSDP2's CPUOffloadPolicy
        # (its shards and gradients on the host; here the host is the device, so the copies are not seen)
        ("llama", 4, 64, 2, "hsdp", False, True, True),
        pytest.param("llama", 4, 64, 2, "hsdp", False, True, False, marks=pytest.mark.slow),
        pytest.param("gpt", 4, 45, 1, "world", True, False, False, marks=pytest.mark.slow),  # every rank; tied
    ],
)
def test_fsdp_step_matches_one_device(pools, kind, b, L, dp, over, reshard, as_module, offload):
    args = (kind, b, L, dp, over, 2, reshard, torch.float64, as_module, offload)
    for r in pools(4).run(cases.fsdp_exactness, *args):
        for loss, ref in r["losses"]:
            assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)  # llama's loss is fp32 (logits upcast)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-10, worst
        assert r["param_err"] <= 1e-10
        # ZeRO-3: each rank holds 1/ranks of the parameters (ceil rows) and of AdamW's two moments
        assert r["full_numel"] <= r["local_numel"] * r["shard_ranks"] < 1.1 * r["full_numel"]
        assert r["state_numel"] == 2 * r["local_numel"]
        (forward, gloo_forward), (backward, gloo_backward) = r["gathers"]
        assert forward == r["params"] and gloo_forward >= forward
        # resharded blocks gather again what the backward reads (not biases); the root keeps its own
        assert (0 < backward <= r["block_params"]) if reshard else backward == 0, (backward, r["block_params"])
        assert gloo_backward >= backward
        assert any(n.startswith(f"FSDP2: {r['params']} parameters") for n in r["notes"]), r["notes"]


@pytest.mark.parametrize("over", ["dp", "world"])
def test_fsdp_gather_and_reduce_on_uneven_shards(pools, over):
    for r in pools(4).run(cases.fsdp_ops, over):
        err = r.pop("error")
        assert "output_dtype" in err, err
        assert r.pop("replicated_grad") <= 1e-6  # counted once, not once per sp rank
        no_sync = r.pop("no_sync")  # never silently reduce what the user asked to keep local
        assert "set_requires_gradient_sync(False)" in no_sync, no_sync
        hidden = r.pop("hidden")  # an FSDP module the step reaches only through a dict of lists
        assert "FSDP2 module" in hidden and "autosp.shard(model)" in hidden, hidden
        for (size, dim), (shape, gather_err, reduce_err, same_shape) in r.items():
            assert gather_err == 0.0, (size, dim, shape)
            assert same_shape and reduce_err <= 1e-12, (size, dim, shape, reduce_err)
