"""``autosp plan`` beyond the step's own memory: where parameters, gradients and optimizer state
live (FSDP2's sharding, host offload), the device table, and the JSON summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_models import TINY_HF

from autosp._cli import Traced, _placement, _shards
from autosp._devices import DEVICES, device

ROOT = Path(__file__).resolve().parent.parent


def test_fsdp_shards_the_state_and_the_gradients_and_gathers_a_layer_at_a_time():
    """Parameters and AdamW's mixed-precision state (12 bytes a parameter) sharded over 8 ranks:
    an eighth of each on the device; the step's gradients (held whole in the trace) kept as a
    shard; three layers' parameters gathered at a time. With host offload, the device holds none
    of it and the host parameters, gradients and optimizer state, sharded."""
    pytest.importorskip("transformers")
    import transformers as T

    cfg = dict(TINY_HF)
    config = T.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * 2

    whole = _placement(TINY_HF, torch.bfloat16, "adamw-mixed")
    assert (whole.params, whole.optimizer, whole.layer) == (2 * numel, 12 * numel, layer)
    assert whole.device == 14 * numel and whole.host == 0
    sharded = _placement(TINY_HF, torch.bfloat16, "adamw-mixed", shards=8)
    assert sharded.device == 14 * numel // 8 and sharded.host == 0
    offloaded = _placement(TINY_HF, torch.bfloat16, "adamw-mixed", shards=8, offload=True)
    assert offloaded.device == 0 and offloaded.host == (2 + 2 + 12) * numel // 8

    t = Traced("auto", "full", activations=1000, comm_bytes=0.0, collectives=0, recompute=0.0, grads=400,
               forward_peak=500, backward_peak=1000)  # fmt: skip
    assert whole.activations(t) == 1000  # as traced
    assert sharded.activations(t) == 1000 - 400 + 400 // 8 + 3 * layer
    assert offloaded.activations(t) == 1000 - 400 + 3 * layer
    forward_bound = Traced("auto", "full", 1000, 0.0, 0, 0.0, grads=400, forward_peak=900, backward_peak=1000)
    assert sharded.activations(forward_bound) == 900 + 3 * layer  # the forward's peak holds no gradient


def test_fsdp_shards_over_the_ranks_its_mode_names():
    assert [_shards(m, sp=8, dp=4, per_node=8) for m in ("none", "sp", "dp", "world", "hsdp")] == [1, 8, 4, 32, 8]
    assert _shards("hsdp", sp=2, dp=2, per_node=8) == 4


def test_devices_are_named_and_their_link_is_the_node_s_until_the_group_spans_nodes():
    assert device("H100") is DEVICES["h100"]
    with pytest.raises(ValueError, match="known: h100, h200, a100, b200, mi300x"):
        device("tpu")
    h100 = DEVICES["h100"]
    assert h100.link_bandwidth(8) == h100.intra_node_bandwidth > h100.link_bandwidth(16) == h100.inter_node_bandwidth
    assert all(d.hbm_bytes > 0 and d.balance > 50 and d.source for d in DEVICES.values())
    # the roofline: a second of flops at peak, a second of HBM traffic, a second on the link
    t = h100.step_time(h100.bf16_flops, h100.hbm_bandwidth, h100.intra_node_bandwidth, ranks=8, overhead=0.5)
    assert t == pytest.approx(2 * 1.5 + 1)


@pytest.mark.slow
def test_plan_json_states_device_and_host_bytes_and_shards_for_a_longer_sequence(tmp_path):
    """``--json``: one object with the longest sequence, the bytes per rank on the device and on
    the host, the rung, the attention, the bytes sent and the roofline's step time; FSDP over the
    world fits a longer sequence than every rank holding the whole state, and host offload longer
    still, its state on the host; with the layers' activations offloaded (``--offload``, the
    first rung that fits: ``budget``) longer than FSDP alone, within ``--host-memory``."""
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_HF))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))

    def plan(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "autosp", "plan", "--model", str(config), "--sp", "4", "--dtype", "fp32",
             "--memory", "24MiB", "--optimizer", "adamw-mixed", "--checkpoint", "auto", "--json", *extra],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    whole, world, offload = (
        plan(),
        plan("--fsdp", "world"),
        plan("--fsdp", "world", "--cpu-offload"),
    )
    for got in (whole, world, offload):
        assert {"longest_sequence", "per_rank_device_bytes", "per_rank_host_bytes", "rung", "attention",
                "offloaded_bytes", "comm_bytes_per_step", "predicted_step_time_s"} <= set(got), got  # fmt: skip
        assert got["per_rank_device_bytes"] <= 24 * 2**20 and got["longest_sequence"] > 0, got
    assert whole["longest_sequence"] < world["longest_sequence"] < offload["longest_sequence"], (whole, world, offload)
    assert whole["per_rank_host_bytes"] == world["per_rank_host_bytes"] == 0 < offload["per_rank_host_bytes"]
    # a device gives the roofline's step time, and weighs the rungs at its figures (``Options.device``:
    # "auto" recomputes less at an H100's balance, so the lengths are not comparable with the CPU's);
    # attention forced to flash: fp32 with grouped K/V is SDPA's math fallback on the GPU
    timed = plan("--fsdp", "world", "--device", "h100", "--attention-kernel", "flash")
    assert timed["predicted_step_time_s"] > 0 and whole["predicted_step_time_s"] is None, timed
    assert timed["attention"].startswith("CUDA flash kernel"), timed
    # "budget" with --offload: the first rung that fits, offloaded ones among them, reaches further;
    # host memory bounds it where it is given
    budget = plan("--fsdp", "world", "--offload", "--checkpoint", "budget")
    assert budget["longest_sequence"] > world["longest_sequence"] and budget["checkpoint"] == "budget", budget
    assert budget["offloaded_bytes"] > 0 and budget["per_rank_host_bytes"] == budget["offloaded_bytes"], budget
    assert budget["rung"].endswith(", offloaded"), budget
    host = budget["offloaded_bytes"] * 4 // 2  # a node's host memory for half of the 4 ranks' offloaded bytes
    bounded = plan("--fsdp", "world", "--offload", "--checkpoint", "budget", "--host-memory", str(host))
    assert bounded["longest_sequence"] < budget["longest_sequence"], (bounded, budget)
    assert bounded["per_rank_host_bytes"] <= host // 4, bounded
