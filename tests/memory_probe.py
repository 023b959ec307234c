"""Predicted against measured peak memory of one rank's training step (run as a script, in its own
process: one rank of an sp job on a fake process group). Prints one JSON line per case.

    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 python tests/memory_probe.py [--steps 5] 4096:2:none 8192:4:full

Each case is seq:sp:checkpoint; step_s is the median step time (the model of the "small"
benchmark preset, aot_eager, one thread).

With every allocation over 64 KiB mmapped and unmapped on free, RSS follows the live tensors;
/proc/self/clear_refs resets the high-water mark before each measured step.
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autosp
from examples.models import Llama, LlamaConfig


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(seq: int, sp: int, checkpoint, steps: int = 2) -> dict:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=256, layers=4, heads=8, kv_heads=4, ffn=768, vocab=256))
    ids = torch.randint(0, 256, (1, seq))
    with autosp.mesh(sp=sp):
        step = autosp.shard(lambda i, l: model(i, l), compiler="aot_eager", checkpoint=checkpoint)
        for _ in range(2):
            step(ids, ids).backward()
            model.zero_grad(set_to_none=True)
        peaks, times = [], []
        for _ in range(steps):
            Path("/proc/self/clear_refs").write_text("5")
            base = _status("VmRSS")
            t0 = time.perf_counter()
            step(ids, ids).backward()
            times.append(time.perf_counter() - t0)
            peaks.append(_status("VmHWM") - base)
            model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    return {"seq": seq, "sp": sp, "checkpoint": checkpoint, "measured": min(peaks),
            "step_s": sorted(times)[len(times) // 2],
            "predicted": step.plan.memory.peak, "chosen": step.plan.checkpoint.chosen}


if __name__ == "__main__":
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("cases", nargs="+", help="seq:sp:checkpoint")
    args = ap.parse_args()
    for case in args.cases:
        seq, sp, ck = case.split(":")
        print(json.dumps(measure(int(seq), int(sp), int(ck) if ck.isdigit() else ck, args.steps)), flush=True)
