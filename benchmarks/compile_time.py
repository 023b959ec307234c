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
  alike blocks were captured once.

A point past ``--timeout`` seconds is reported as such. The machine must be otherwise idle: the
figures are wall-clock times of one process on one core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

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
if kind == "plain":
    step = torch.compile(lambda a, b: model(a, b), backend="aot_eager", fullgraph=True)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        step(ids, ids).backward()
        times.append(time.perf_counter() - t0)
    out["seconds"] = times[0] - times[1]
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


def run_point(kind: str, layers: int, sp: int, seq: int, dim: int, heads: int, timeout: float) -> dict:
    """One point in a fresh process: its result, or ``seconds`` None and why."""
    args = [sys.executable, "-c", _POINT, kind, *map(str, (layers, sp, seq, dim, heads))]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
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
    """Markdown: one row per (layers, sp), plain's seconds and autosp's with the ratios."""
    each = any(r["kind"] == "symbolic-each" for r in results)
    rows = ["| layers | sp | plain (s) | static (s) | symbolic (s) | static / plain | symbolic / static |"]
    rows[0] += " symbolic, every block traced (s) |" if each else ""
    rows.append("|---|---|---|---|---|---|---|" + ("---|" if each else ""))
    points = sorted({(r["layers"], r["sp"]) for r in results})
    for layers, sp in points:
        got = {r["kind"]: r.get("seconds") for r in results if (r["layers"], r["sp"]) == (layers, sp)}
        fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        ratio = lambda a, b: "-" if a is None or b is None or not b else f"{a / b:.2f}x"  # noqa: E731
        p, s, y = got.get("plain"), got.get("static"), got.get("symbolic")
        row = f"| {layers} | {sp} | {fmt(p)} | {fmt(s)} | {fmt(y)} | {ratio(s, p)} | {ratio(y, s)} |"
        rows.append(row + (f" {fmt(got.get('symbolic-each'))} |" if each else ""))
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,8")
    ap.add_argument("--sp", default="2,8")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=256, help="model width (heads: 8, or the largest sp)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--kinds", default="plain,static,symbolic", help=f"of {','.join(KINDS)}")
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
    for layers in layers_list:
        if "plain" in kinds:  # the same for every sp
            plain = run_point("plain", layers, 1, args.seq, args.dim, heads, args.timeout)
        for sp in sps:
            if "plain" in kinds:
                record({**plain, "sp": sp})
            for kind in (k for k in KINDS[1:] if k in kinds):
                record(run_point(kind, layers, sp, args.seq, args.dim, heads, args.timeout))
    print(table(results))


if __name__ == "__main__":
    main()
