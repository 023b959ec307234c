"""The benchmark runner fails well: a worker that dies at import or is killed mid-step ends its
configuration's record with the error and the worker's traceback, within seconds, and the run
goes on to the next configuration and writes its table and plots."""

import json
import time

import pytest

from benchmarks import run


def _cfg(system: str, **kw) -> dict:
    return (
        dict(
            system=system,
            seq=256,
            sp=2,
            preset="tiny",
            device="cpu",
            compiler="aot_eager",
            rank_local=False,
            steps=1,
            warmup=1,
            batch=1,
            ulysses=None,
            dp=1,
            threads=1,
            timeout=120,
        )
        | kw
    )


def test_a_worker_that_dies_at_import_gets_a_record_with_its_traceback(tmp_path, monkeypatch):
    """A module the worker imports is broken (a yaml.py ahead of the real one): the worker exits
    with an ImportError before it can report anything. Without watching the processes the parent
    waited for the record until the timeout (900 s by default)."""
    (tmp_path / "yaml.py").write_text("raise ImportError('yaml is broken in this test')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    t0 = time.monotonic()
    rec = run.run_config(_cfg("single"), timeout=120)
    assert time.monotonic() - t0 < 60
    assert rec["error"].startswith("worker(s) died (rank, exit code): (0, 1)"), rec["error"]
    assert "ImportError: yaml is broken in this test" in rec["traceback"], rec["traceback"]


def test_a_worker_killed_mid_step_ends_its_record_and_the_run_goes_on(tmp_path, monkeypatch):
    """Rank 1 of a 2-rank configuration is killed at its second step (SIGKILL: nothing of it is
    reported) while rank 0 waits on it in a collective: the configuration's record names the dead
    rank, the next configuration runs, and the table and both plots are written."""
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("AUTOSP_BENCH_KILL", "1:2")
    t0 = time.monotonic()
    run.main(
        [
            "--systems",
            "ulysses_eager,single",
            "--seqs",
            "256",
            "--preset",
            "tiny",
            "--steps",
            "1",
            "--compiler",
            "aot_eager",
            "--timeout",
            "120",
            "--out",
            str(tmp_path),
        ]
    )
    assert time.monotonic() - t0 < 110
    killed, single = json.loads((tmp_path / "results.json").read_text())["records"]
    assert killed["system"] == "ulysses_eager" and "(1, -9)" in killed["error"], killed
    assert killed["traceback"], killed
    assert single["system"] == "single" and single["error"] is None and single["step_time_s"] > 0, single
    for name in ("results.md", "step_time.png", "peak_mem.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.slow
def test_compile_time_benchmark_runs_each_point_in_its_own_process():
    """``benchmarks.compile_time`` at its smallest: plain ``torch.compile`` and autosp's static and
    symbolic planning (blocks captured once, and each traced) of a 1-layer model on 2 fake ranks,
    each timed in a fresh process, the plan's phase times with it; a point past its timeout is
    reported as such; and the first step under Inductor, plain and autosp's on 2 gloo processes."""
    from benchmarks import compile_time

    got = {k: compile_time.run_point(k, 1, 2, 64, 64, 8, 600) for k in compile_time.KINDS}
    assert all(r["seconds"] is not None and r["seconds"] > 0 for r in got.values()), got
    assert set(got["symbolic"]["timings"]) == {"capture", "propagate", "solve", "localize", "checkpoint"}, got
    assert got["static"]["collectives"] == got["symbolic"]["collectives"] == got["symbolic-each"]["collectives"] > 0
    late = compile_time.run_point("symbolic", 1, 2, 64, 64, 8, 1.0)
    assert late["seconds"] is None and late["why"] == "over 1 s", late
    assert "| 1 | 2 |" in compile_time.table([*got.values(), late])
    # the first step under Inductor: plain, and autosp's defaults on 2 gloo processes (torchrun)
    first = {k: compile_time.run_point(k, 1, 2, 64, 64, 8, 900) for k in compile_time.INDUCTOR_KINDS}
    assert all(r["seconds"] is not None and r["seconds"] > 0 for r in first.values()), first
    assert first["inductor"]["timings"]["compile"] > 0 and first["inductor"]["collectives"] > 0, first
    assert "Inductor: autosp / plain" in compile_time.table([*got.values(), *first.values()])
