"""Memory against the alternatives: the longest sequence each system trains under one memory
budget per rank (bisection on measured peaks), and step time and peak at a common length.

    python -m benchmarks.memory --out runs/memory                 # budget 256 MiB per rank, sp=2
    python -m benchmarks.memory --quick --out runs/memory_quick   # aot_eager, fewer points

Systems, all on the same model (the "small" preset of benchmarks.run) and one rank's share of an
sp job (a fake process group: collectives cost nothing, so the times compare compute, and the
memory is exactly what one rank of a real job holds):
- ulysses: hand-written DeepSpeed-Ulysses (examples/ulysses.py), torch.compile'd, its gradients
  summed over the group afterwards (allreduce_grads, in place) as autosp's step does in its graph;
- ulysses_ckpt: the same with per-layer torch.utils.checkpoint;
- autosp_none / autosp_auto / autosp_full: autosp with checkpoint="none" / "auto" / "full";
- autosp_budget: autosp with checkpoint=<the budget>.
Every measurement runs in a fresh process (compile and RSS of its own). Peak memory is the growth
of peak RSS during a step over the RSS before it (gradients set to None first), with glibc
mmapping every allocation over 64 KiB so that RSS follows the live tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.tables import budget_table

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ["ulysses", "ulysses_ckpt", "autosp_none", "autosp_auto", "autosp_full", "autosp_budget"]
PRESET = dict(dim=256, layers=4, heads=8, kv_heads=4, ffn=768, vocab=256)


def measure_here(system: str, seq: int, sp: int, budget: int, compiler: str, steps: int, attn: str = "sdpa") -> dict:
    """One measurement in this process (a fresh one, or one that measures nothing else at the
    same time: glibc must mmap large allocations, see ``measure``)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autosp
    from benchmarks.run import _peak, _reset_peak
    from examples.models import Llama, LlamaConfig
    from examples.ulysses import allreduce_grads, ulysses_loss

    torch.set_num_threads(int(os.environ.get("AUTOSP_BENCH_THREADS", "1")))
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**PRESET, attn=attn))
    ids = torch.randint(0, PRESET["vocab"], (1, seq))
    rec = {"system": system, "seq": seq, "sp": sp}
    with autosp.mesh(sp=sp):
        if system.startswith("ulysses"):
            loss_fn = torch.compile(
                lambda i, y: ulysses_loss(model, i, y, checkpoint=system == "ulysses_ckpt")[0], backend=compiler
            )

            def run():
                loss_fn(ids, ids).backward()
                allreduce_grads(model)  # as autosp's step does inside its graph
        else:
            setting = system.removeprefix("autosp_")
            step = autosp.shard(
                lambda i, y: model(i, y),
                compiler=compiler,
                checkpoint=budget if setting == "budget" else setting,
                attention=os.environ.get("AUTOSP_BENCH_ATTENTION", "auto"),
            )

            def run():
                step(ids, ids).backward()

        try:
            for _ in range(2):
                run()
                model.zero_grad(set_to_none=True)
        except autosp.PlanError as e:
            return {**rec, "error": str(e).splitlines()[0][:300]}
        peaks, times = [], []
        for _ in range(steps):
            base = _reset_peak("cpu")
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
            peaks.append(_peak("cpu") - base)
            model.zero_grad(set_to_none=True)
    rec.update(peak_mem_bytes=min(peaks), step_time_s=statistics.median(times), error=None)
    if not system.startswith("ulysses"):
        rec.update(predicted_bytes=step.plan.memory.peak, checkpoint=step.plan.checkpoint.chosen)
    torch._dynamo.reset()
    return rec


def measure(system: str, seq: int, args) -> dict:
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        MALLOC_TRIM_THRESHOLD_="0",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
    )
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.memory",
        "--one",
        json.dumps([system, seq, args.sp, args.budget, args.compiler, args.steps, args.attn]),
    ]
    try:
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as e:
        return {
            "system": system,
            "seq": seq,
            "sp": args.sp,
            "error": "timed out after 1800 s",
            "traceback": (e.stderr or b"").decode(errors="replace")[-4000:]
            if isinstance(e.stderr, bytes)
            else (e.stderr or "")[-4000:],
        }
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = out.stderr.strip().splitlines() or ["no output"]
        return {
            "system": system,
            "seq": seq,
            "sp": args.sp,
            "error": tail[-1][:300],
            "traceback": "\n".join(tail[-40:]),
        }
    rec = json.loads(lines[-1])
    print(json.dumps(rec), flush=True)
    return rec


def longest(system: str, args, records: list) -> int:
    """The longest multiple of the granule whose measured peak fits the budget (0 if none)."""
    g = args.granule

    def fits(seq: int) -> bool:
        r = measure(system, seq, args)
        records.append(r)
        return not r.get("error") and r["peak_mem_bytes"] <= args.budget

    lo, hi = 0, args.start
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > g:
        mid = (lo + hi) // 2 // g * g
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/memory"))
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--budget", type=int, default=256 * 2**20, help="bytes per rank")
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--attn",
        default="sdpa",
        choices=["sdpa", "gqa"],
        help="the model's attention: K/V repeated to the query heads before SDPA (as Hugging Face's "
        "repeat_kv), or SDPA on the unrepeated K/V (enable_gqa), for every system",
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure_here(*json.loads(args.one))), flush=True)
        return
    if args.quick:
        args.compiler, args.steps = "aot_eager", 2
    args.granule = 512 * args.sp
    args.start = 4 * args.granule
    systems = args.systems.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    longest_seq = {s: longest(s, args, records) for s in systems}
    # step time and peak at one length every system fits: the longest hand-written Ulysses fits
    common = min(v for v in longest_seq.values() if v) if any(longest_seq.values()) else args.start
    at_common = {s: measure(s, common, args) for s in systems}
    summary = {
        "budget_bytes": args.budget,
        "sp": args.sp,
        "compiler": args.compiler,
        "preset": PRESET,
        "attn": args.attn,
        "longest_seq": longest_seq,
        "common_seq": common,
        "at_common": at_common,
    }
    machine = {"host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    (args.out / "results.json").write_text(
        json.dumps({"machine": machine, "summary": summary, "records": records}, indent=1)
    )
    rows = [
        f"budget {args.budget / 2**20:.0f} MiB per rank, sp={args.sp} (one rank's share), {args.compiler}, "
        f"model {PRESET}, attention {args.attn}",
        "",
        *budget_table(summary),
    ]
    (args.out / "results.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
