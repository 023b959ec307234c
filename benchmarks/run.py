"""Side-by-side benchmarks: step time, tokens/s, compile time, communication and peak memory,
for one model, mesh and set of sequence lengths, in one run.

    python -m benchmarks.run --quick --out runs/bench          # < 5 minutes on 2 CPU cores
    python -m benchmarks.run --out runs/bench                  # the full set
    python -m benchmarks.run --device cuda --sp 2 --out ...    # NCCL, Inductor/Triton
    python -m benchmarks.run --device cuda --rank-local --sp 8 --seqs 65536 --preset llama-1b
        # one GPU: one rank's share of an 8-rank job, collectives on a fake process group
    python -m benchmarks.run --sp 2 --dp 2 --batch 2 --systems autosp,autosp_fsdp ...   # a 2 x 2 mesh
    python -m benchmarks.run --sp 4 --ulysses 2 --systems autosp,autosp_hybrid ...      # hybrid attention

Every configuration runs in fresh processes (one per rank), so compile time and peak memory are
its own; a configuration whose worker fails, dies or hangs (``--timeout``) gets a record with the
error and the worker's traceback (``results.json``), and the run goes on. Communication is what
gloo/NCCL actually ran in one step (torch.profiler's collective events, elements x 4 bytes: the
models are fp32), never autosp's plan. Peak memory is the growth
of the peak over the memory held after warm-up (parameters and gradients), during the timed
steps: activations, temporaries and communication buffers. On CPU that is RSS, with glibc told
to mmap every allocation over 64 KiB so that RSS follows the live tensors, and
/proc/self/clear_refs resetting the high-water mark; on GPU torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.lengths import measure_lengths
from benchmarks.tables import lengths_table, runs_table

ROOT = Path(__file__).resolve().parent.parent

PRESETS = {
    # dim, layers, heads, kv_heads, ffn, vocab
    "tiny": dict(dim=128, layers=2, heads=8, kv_heads=4, ffn=384, vocab=256),
    "small": dict(dim=256, layers=4, heads=8, kv_heads=4, ffn=768, vocab=256),
    "small-2kv": dict(dim=256, layers=4, heads=8, kv_heads=2, ffn=768, vocab=256),  # K/V heads < 4 ranks
    "medium": dict(dim=1024, layers=4, heads=8, kv_heads=4, ffn=2816, vocab=32000),
    "llama-1b": dict(dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
}


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    return _rss_bytes("VmRSS")


def _peak(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _rss_bytes("VmHWM")


def _held_bytes(model, optimizer) -> int:
    """Bytes this rank holds in parameters, gradients and optimizer state, counted from the
    tensors themselves (the local shard of a DTensor)."""

    def nbytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    held = sum(nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
    if optimizer is not None:
        held += sum(nbytes(t) for state in optimizer.state.values() for t in state.values())
    return held


def _comm_bytes(prof, element_size: int) -> int:
    total = 0
    for e in prof.events():
        if e.name.startswith(("gloo:", "nccl:")) and e.input_shapes:
            shape = e.input_shapes[0]
            total += (int(torch.tensor(shape).prod().item()) if shape else 1) * element_size
    return total


def _kill_here(rank: int, call: int) -> None:
    """Test hook: ``AUTOSP_BENCH_KILL="rank:call"`` kills that rank at that call of the step (1 =
    the first), as a crash mid-run would."""
    spec = os.environ.get("AUTOSP_BENCH_KILL")
    if spec and tuple(map(int, spec.split(":"))) == (rank, call):
        os.kill(os.getpid(), signal.SIGKILL)


def _measure(run, ids, cfg: dict, rank: int) -> dict:
    """Compile (the first call), warm up, then time ``cfg["steps"]`` steps and profile one."""
    device, calls = cfg["device"], 0

    def step():
        nonlocal calls
        calls += 1
        _kill_here(rank, calls)
        return run()

    t0 = time.perf_counter()
    loss = step()
    compile_time = time.perf_counter() - t0
    for _ in range(cfg["warmup"] - 1):
        step()
    # after compilation (whose own memory is not the step's) and with gradients allocated
    held = _held_bytes(run.model, getattr(run, "optimizer", None))
    base = _reset_peak(device)
    times = []
    for _ in range(cfg["steps"]):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = _peak(device) - base
    with torch.profiler.profile(record_shapes=True) as prof:
        step()
    med = statistics.median(times)
    return dict(
        step_time_s=med,
        tokens_per_s=ids.numel() / med,
        compile_time_s=max(compile_time - med, 0.0),
        comm_bytes_per_step=_comm_bytes(prof, 4),
        peak_mem_bytes=peak,
        held_bytes=held,
        base_mem_bytes=base,
        loss=loss,
        error=None,
    )


def _worker(rank: int, world: int, port: int, cfg: dict) -> dict:
    """One rank of one configuration (in a process of its own): its record."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(cfg["threads"])
    import torch.distributed as dist

    import autosp
    from benchmarks.systems import SYSTEMS
    from examples.models import Llama, LlamaConfig

    device = cfg["device"]
    record = {k: cfg[k] for k in ("system", "seq", "sp")} | {"dp": cfg.get("dp", 1)}
    try:
        if cfg["rank_local"]:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg["sp"])
        dp = cfg.get("dp", 1) if world > 1 else 1
        if dp > 1 and not cfg["system"].startswith("autosp"):
            raise ValueError(f"{cfg['system']} runs sequence parallel only (no dp)")
        sp = world // dp if not cfg["rank_local"] else cfg["sp"]
        with autosp.mesh(
            sp=sp, dp=dp, ulysses=cfg.get("ulysses") if world > 1 else None, timeout_s=cfg["timeout"]
        ) as mesh:
            torch.manual_seed(0)
            model = Llama(LlamaConfig(**PRESETS[cfg["preset"]])).to(device)
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, model.c.vocab, (cfg["batch"], cfg["seq"]), generator=g).to(device)
            if cfg.get("lengths"):
                record.update(measure_lengths(model, cfg, lambda prof: _comm_bytes(prof, 4)))
                return record
            mine = ids.tensor_split(dp)[mesh.dp_rank] if dp > 1 else ids  # this dp replica's batch
            run = SYSTEMS[cfg["system"]](model, mine, mine.clone(), mesh, cfg["compiler"])
            run.model = model
            record.update(_measure(run, ids, cfg, rank))
    except Exception as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        record.update(
            error=f"{type(e).__name__}: {first}" if first else type(e).__name__, traceback=traceback.format_exc()
        )
    return record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _died(procs: list[subprocess.Popen]) -> str | None:
    dead = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
    return "worker(s) died (rank, exit code): " + ", ".join(f"({r}, {c})" for r, c in dead) if dead else None


def _wait(procs: list[subprocess.Popen], timeout: float, grace: float = 10.0) -> str | None:
    """Wait for every worker; None when all exited cleanly, else what went wrong: a worker died
    (the others, likely waiting on it in a collective, get ``grace`` seconds), or the deadline
    passed. Workers still running then dump their Python stacks (SIGUSR1, faulthandler) and are
    killed."""
    deadline, why = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        if why is None and (why := _died(procs)) is not None:
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            why = why or f"timed out after {timeout:.0f} s"
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    return why or _died(procs)


def run_config(cfg: dict, timeout: float) -> dict:
    """One configuration, one fresh process per rank. A worker that fails, dies or hangs ends the
    configuration's record with the error and its traceback (or the tail of its output)."""
    world = 1 if cfg["system"] == "single" or cfg["rank_local"] else cfg["sp"] * cfg.get("dp", 1)
    port = _free_port()
    base = {k: cfg[k] for k in ("system", "seq", "sp")} | {"dp": cfg.get("dp", 1)}
    # glibc keeps freed heap pages, so RSS would not fall after a step; with every allocation
    # over 64 KiB mmapped (and unmapped on free), RSS follows the live tensors
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        MALLOC_TRIM_THRESHOLD_="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    with tempfile.TemporaryDirectory(prefix="autosp-bench-") as tmp:
        if cfg.get("lengths"):  # compile times as a first run measures them: Inductor's caches empty
            env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        out = [Path(tmp) / f"rank{r}.json" for r in range(world)]
        logs = [Path(tmp) / f"rank{r}.log" for r in range(world)]
        procs = []
        for r in range(world):
            with open(logs[r], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "benchmarks.run",
                            "--worker",
                            json.dumps([r, world, port, cfg]),
                            str(out[r]),
                        ],
                        env=env,
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        why = _wait(procs, timeout)
        by_rank = {r: json.loads(out[r].read_text()) for r in range(world) if out[r].exists()}
        failed = [r for r in range(world) if r not in by_rank or by_rank[r].get("error")]
        rec = by_rank.get(0) or next(iter(by_rank.values()), dict(base))
        if why is not None or failed:
            r = next((r for r in failed if r in by_rank), failed[0] if failed else 0)
            mine = by_rank.get(r, {})
            error = "; ".join(x for x in (why, f"rank {r}: {mine['error']}" if mine.get("error") else None) if x)
            rec = dict(base, error=error, traceback=mine.get("traceback") or f"rank {r}:\n{_tail(logs[r])}")
        elif len(by_rank) > 1:
            for k in ("peak_mem_bytes", "held_bytes", "base_mem_bytes"):
                if k in rec:
                    rec[k] = max(x[k] for x in by_rank.values())
    rec["mode"] = (
        "rank-local" if cfg["rank_local"] else ("single-device" if cfg["system"] == "single" else f"{world} ranks")
    )
    if cfg["system"] == "single":
        rec["sp"] = 1
    return rec


def _plots(records: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, label, fname in (
        ("step_time_s", "step time (s)", "step_time.png"),
        ("peak_mem_bytes", "peak memory per rank (MiB)", "peak_mem.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for system in dict.fromkeys(r["system"] for r in records):
            pts = sorted(
                (r["seq"], r[key] / (2**20 if "mem" in key else 1))
                for r in records
                if r["system"] == system and not r.get("error")
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--systems", default="single,ulysses_eager,ulysses_compiled,dtensor,context_parallel,autosp")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--rank-local", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel replicas (autosp.mesh(dp=...)); --batch is the global batch, each replica its slice",
    )
    ap.add_argument(
        "--ulysses",
        type=int,
        default=None,
        help="lay sp out as sub-groups of this many ranks (autosp.mesh(ulysses=...)), for hybrid attention",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a configuration may take")
    ap.add_argument(
        "--lengths",
        type=int,
        default=0,
        help="train this many steps of lengths drawn from an SFT distribution (64-4096 tokens) on one autosp "
        "step with symbolic lengths, against fixed-length training at the first of --seqs (default 1024)",
    )
    ap.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)  # [rank, world, port, cfg], out file
    args = ap.parse_args(argv)
    if args.worker:
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks before a kill
        rank, world, port, cfg = json.loads(args.worker[0])
        Path(args.worker[1]).write_text(json.dumps(_worker(rank, world, port, cfg)))
        sys.stdout.flush()
        # no destroy_process_group: it waits on the peers, and there is nothing to flush
        os._exit(0)
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else ([4096] if args.quick else [1024, 2048, 4096, 8192])
    preset = args.preset or ("tiny" if args.quick else "small")
    if args.lengths:
        return _lengths_main(args, int(args.seqs.split(",")[0]) if args.seqs else 1024, preset)
    systems = args.systems.split(",")
    if args.quick:
        systems = [s for s in systems if s != "ulysses_eager"]
    args.out.mkdir(parents=True, exist_ok=True)
    records = [_record(args, system, seq, preset) for seq in seqs for system in systems]
    _write(args, records, runs_table(records))
    _plots(records, args.out)


def _record(args, system: str, seq: int, preset: str, **extra) -> dict:
    """One configuration's record (printed as it comes)."""
    threads = max(1, (os.cpu_count() or 1) // (1 if args.rank_local else args.sp))
    cfg = dict(
        system=system,
        seq=seq,
        sp=args.sp,
        preset=preset,
        device=args.device,
        compiler=args.compiler,
        rank_local=args.rank_local,
        steps=args.steps,
        warmup=2,
        batch=args.batch,
        ulysses=args.ulysses,
        dp=args.dp,
        threads=threads if system != "single" else (os.cpu_count() or 1),
        timeout=args.timeout,
        **extra,
    )
    rec = run_config(cfg, timeout=args.timeout)
    rec.update(preset=preset, device=args.device, compiler=args.compiler)
    print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
    if rec.get("traceback"):
        print(rec["traceback"], file=sys.stderr, flush=True)
    return rec


def _write(args, records: list[dict], table: list[str]) -> None:
    """results.json (with the machine) and results.md in ``--out``; the table printed."""
    machine = {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if args.device == "cuda" else None,
    }
    (args.out / "results.json").write_text(json.dumps({"machine": machine, "records": records}, indent=1))
    (args.out / "results.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


def _lengths_main(args, seq: int, preset: str) -> None:
    """``--lengths N``: one record (``benchmarks.lengths``)."""
    args.out.mkdir(parents=True, exist_ok=True)
    record = _record(args, "autosp", seq, preset, lengths=args.lengths)
    _write(args, [record], lengths_table(record))


if __name__ == "__main__":
    main()
