"""Predicted against measured peak memory of one rank's training step, for the settings given
(run as a script, in its own process: one rank of an sp job on a fake process group; the
measurement is benchmarks.memory's). Prints one JSON line per case.

    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 python tests/memory_probe.py [--steps 5] \
        [--compiler inductor] 4096:2:none 8192:4:full 4096:2:125829120

Each case is seq:sp:checkpoint (a checkpoint setting, or a budget in bytes); the model is the
"small" benchmark preset, one thread. ``AUTOSP_BENCH_ATTENTION=ring`` (or another kernel) forces
the attention kernel of the autosp cases.
"""

import argparse
import json

from benchmarks.memory import measure_here

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor"])
    ap.add_argument("cases", nargs="+", help="seq:sp:checkpoint")
    args = ap.parse_args()
    for case in args.cases:
        seq, sp, ck = case.split(":")
        system, budget = ("autosp_budget", int(ck)) if ck.isdigit() else (f"autosp_{ck}", 0)
        print(json.dumps(measure_here(system, int(seq), int(sp), budget, args.compiler, args.steps)), flush=True)
