"""Multi-node launch: two torchrun agents (--nnodes 2, one process each) on this machine over
loopback, as on two hosts, run the main job and get the single-device losses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _pool import _free_port

ROOT = Path(__file__).resolve().parent.parent


def _train_cmd(out: Path) -> list[str]:
    return [
        str(ROOT / "examples" / "train.py"),
        "--steps",
        "3",
        "--seq",
        "64",
        "--batch",
        "2",
        "--no-reference",
        "--out",
        str(out),
    ]


@pytest.mark.slow
def test_two_torchrun_nodes_match_one_device(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = _free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                *_train_cmd(tmp_path / "sp2"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    single = subprocess.run(
        [sys.executable, *_train_cmd(tmp_path / "single"), "--plain"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0, single.stdout + single.stderr
    for a in agents:
        out, _ = a.communicate(timeout=600)
        assert a.returncode == 0, out
    sharded = json.loads((tmp_path / "sp2" / "loss.json").read_text())
    ref = json.loads((tmp_path / "single" / "loss.json").read_text())
    assert sharded["sp"] == 2 and ref["sp"] == 1
    for a, b in zip(sharded["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (sharded["losses"], ref["losses"])
