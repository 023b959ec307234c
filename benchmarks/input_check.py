"""What the input check costs (``autosp.shard(check_inputs=...)``): the step's median time with the
check and without, alternating in one run, and the check's own median time.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.input_check [--seq 4096] [--steps 10]

The ``small`` preset of ``benchmarks.run`` on 2 ranks (gloo), aot_eager, one rank's figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import autosp
from autosp.backend._inputs import check_same_inputs
from benchmarks.run import PRESETS
from examples.models import Llama, LlamaConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**PRESETS["small"]))
    ids = torch.randint(0, model.c.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
    with autosp.mesh() as m:
        steps = {
            check: autosp.shard(lambda i, y: model(i, y), compiler="aot_eager", check_inputs=check)
            for check in (True, False)
        }
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(args.steps + 1):
            for check, step in steps.items():
                t0 = time.perf_counter()
                step(ids, ids).backward()
                if i:  # the first is the compile
                    times[check].append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
        groups = m.device_mesh.mesh.reshape(m.dp_size, -1).tolist()
        alone = []
        for _ in range(50):
            t0 = time.perf_counter()
            check_same_inputs([("input_ids", ids), ("labels", ids)], groups)
            alone.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        on, off, chk = (statistics.median(x) for x in (times[True], times[False], alone))
        print(
            f"{args.seq} tokens over {m.sp_size} ranks, {args.steps} steps each, alternating: median step "
            f"{on:.4f} s with the check, {off:.4f} s without ({on / off:.3f}x); the check alone "
            f"{chk * 1e3:.2f} ms ({chk / off:.2%} of the step)"
        )


if __name__ == "__main__":
    main()
