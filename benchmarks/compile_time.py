"""What a first step's compile costs against plain ``torch.compile`` of the same single-device step,
by depth and by sp size (issue: compile at the scale people train).

    OMP_NUM_THREADS=1 python -m benchmarks.compile_time [--layers 2,8] [--sp 2,8] [--seq 1024]
        [--dim 256] [--kinds plain,static,symbolic,symbolic-each] [--timeout 900] [--json out.jsonl]

The example Llama (``examples.models``) at ``--dim`` with ``--layers`` layers and ``--seq`` tokens.
Each point runs in a fresh process (nothing cached between them), one after another:

- ``plain``: ``torch.compile(backend="aot_eager")`` of the single-device step (forward and
  backward): the first call's time less the second's (what compiling added);
- ``static`` / ``symbolic``: ``autosp.explain`` of the sharded step on a fake process group of
  ``sp`` ranks (``aot_eager``; ``dynamic=False`` / the default, symbolic lengths): the whole
  planning pipeline, which stops before the backend compiler (``aot_eager``'s is a wrapper); and
  the plan's own ``timings`` by phase;
- ``symbolic-each``: ``symbolic`` with every block traced (``blocks_once=False``), as before
  alike blocks were captured once;
- ``plain-inductor`` / ``inductor``: the first step (forward and backward) under Inductor, less
  the second's: plain ``torch.compile`` of the single-device step, and ``autosp.shard`` with its
  defaults (Inductor, symbolic lengths) on ``sp`` gloo processes (``torchrun``; rank 0's time),
  each point with its own empty Inductor cache (every kernel compiled, as a first run compiles
  them).

A point past ``--timeout`` seconds is reported as such. The machine must be otherwise idle: the
figures are wall-clock times of one process on one core.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # examples/ and autosp/ import from here

_POINT = r"""
import json, sys, time
import torch
import torch.distributed as dist
from examples.models import Llama, LlamaConfig

kind, layers, sp, seq, dim, heads = sys.argv[1], *map(int, sys.argv[2:7])
torch.manual_seed(0)
model = Llama(LlamaConfig(dim=dim, heads=heads, kv_heads=heads, layers=layers, ffn=4 * dim))
ids = torch.randint(0, model.c.vocab, (1, seq))
out = {"kind": kind, "layers": layers, "sp": sp, "seq": seq, "dim": dim}


def first_less_second(step):
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        step(ids, ids).backward()
        times.append(time.perf_counter() - t0)
    return times[0] - times[1]


if kind in ("plain", "plain-inductor"):
    backend = "inductor" if kind == "plain-inductor" else "aot_eager"
    out["seconds"] = first_less_second(torch.compile(lambda a, b: model(a, b), backend=backend, fullgraph=True))
elif kind == "inductor":  # one of sp gloo processes (torchrun), autosp's defaults
    import autosp
    dist.init_process_group("gloo")
    with autosp.mesh(sp=sp):
        step = autosp.shard(lambda a, b: model(a, b))
        out["seconds"] = first_less_second(step)
        out["timings"] = step.plan.timings
        out["collectives"] = len(step.plan.collectives)
        out["rung"] = step.plan.checkpoint.chosen
    if dist.get_rank() != 0:
        sys.exit(0)
else:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import autosp
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    t0 = time.perf_counter()
    with autosp.mesh(sp=sp):
        step = autosp.shard(
            lambda a, b: model(a, b),
            compiler="aot_eager",
            dynamic=kind.startswith("symbolic"),
            blocks_once=not kind.endswith("-each"),
        )
        plan = autosp.explain(step, ids, ids)
    out["seconds"] = time.perf_counter() - t0
    out["timings"] = plan.timings
    out["collectives"] = len(plan.collectives)
    out["rung"] = plan.checkpoint.chosen
print("RESULT " + json.dumps(out))
"""

# "symbolic-each": symbolic with every block traced (``blocks_once=False``): before blocks were
# captured once, side by side
KINDS = ("plain", "static", "symbolic", "symbolic-each")
# the first step under Inductor, plain and on gloo processes
INDUCTOR_KINDS = ("plain-inductor", "inductor")


def run_point(kind: str, layers: int, sp: int, seq: int, dim: int, heads: int, timeout: float) -> dict:
    """One point in a fresh process (``inductor``: ``sp`` of them, under torchrun): its result, or
    ``seconds`` None and why."""
    point = (kind, *map(str, (layers, sp, seq, dim, heads)))
    env = None
    with contextlib.ExitStack() as stack:
        if kind in INDUCTOR_KINDS:  # an empty Inductor cache: every kernel compiled
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="autosp-compile-time-"))
            path = os.pathsep.join(x for x in (_ROOT, os.environ.get("PYTHONPATH")) if x)
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        if kind == "inductor":
            script = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "point.py")
            with open(script, "w") as f:
                f.write(_POINT)
            run = ["--standalone", f"--nproc-per-node={sp}", script]
            args = [sys.executable, "-m", "torch.distributed.run", *run, *point]
        else:
            args = [sys.executable, "-c", _POINT, *point]
        return _run(args, kind, layers, sp, timeout, env)


def _run(args: list[str], kind: str, layers: int, sp: int, timeout: float, env) -> dict:
    t0 = time.perf_counter()
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=_ROOT)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "layers": layers, "sp": sp, "seconds": None, "why": f"over {timeout:.0f} s"}
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"kind": kind, "layers": layers, "sp": sp, "seconds": None, "why": tail}
    out = json.loads(line[len("RESULT ") :])
    out["process_seconds"] = time.perf_counter() - t0
    return out


def table(results: list[dict]) -> str:
    """Markdown: one row per (layers, sp), plain's seconds and autosp's with the ratios (and, where
    measured, the Inductor first steps and theirs)."""
    each = any(r["kind"] == "symbolic-each" for r in results)
    inductor = any(r["kind"] in INDUCTOR_KINDS for r in results)
    rows = ["| layers | sp | plain (s) | static (s) | symbolic (s) | static / plain | symbolic / static |"]
    rows[0] += " symbolic, every block traced (s) |" if each else ""
    rows[0] += " plain, Inductor (s) | autosp, Inductor, gloo (s) | Inductor: autosp / plain |" if inductor else ""
    rows.append("|---|---|---|---|---|---|---|" + ("---|" if each else "") + ("---|---|---|" if inductor else ""))
    points = sorted({(r["layers"], r["sp"]) for r in results})
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    ratio = lambda a, b: "-" if a is None or b is None or not b else f"{a / b:.2f}x"  # noqa: E731
    for layers, sp in points:
        got = {r["kind"]: r.get("seconds") for r in results if (r["layers"], r["sp"]) == (layers, sp)}
        p, s, y = got.get("plain"), got.get("static"), got.get("symbolic")
        row = f"| {layers} | {sp} | {fmt(p)} | {fmt(s)} | {fmt(y)} | {ratio(s, p)} | {ratio(y, s)} |"
        row += f" {fmt(got.get('symbolic-each'))} |" if each else ""
        if inductor:
            pi, ai = got.get("plain-inductor"), got.get("inductor")
            row += f" {fmt(pi)} | {fmt(ai)} | {ratio(ai, pi)} |"
        rows.append(row)
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,8")
    ap.add_argument("--sp", default="2,8")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=256, help="model width (heads: 8, or the largest sp)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--kinds", default="plain,static,symbolic", help=f"of {','.join(KINDS + INDUCTOR_KINDS)}")
    ap.add_argument("--json", default=None, help="append each point's result to this file (JSON lines)")
    args = ap.parse_args()
    layers_list, sps = [int(x) for x in args.layers.split(",")], [int(x) for x in args.sp.split(",")]
    heads = max(8, *sps)  # one model for every sp (its heads split over the largest)
    results = []

    def record(r: dict) -> None:
        results.append(r)
        print(json.dumps(r), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")

    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS + INDUCTOR_KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}: of {','.join(KINDS + INDUCTOR_KINDS)}")
    single = [k for k in ("plain", "plain-inductor") if k in kinds]  # one device: the same for every sp
    for layers in layers_list:
        plains = [run_point(k, layers, 1, args.seq, args.dim, heads, args.timeout) for k in single]
        for sp in sps:
            for plain in plains:
                record({**plain, "sp": sp})
            for kind in (k for k in KINDS + INDUCTOR_KINDS if k in kinds and k not in single):
                record(run_point(kind, layers, sp, args.seq, args.dim, heads, args.timeout))
    print(table(results))


if __name__ == "__main__":
    main()
