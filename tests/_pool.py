"""A pool of gloo worker processes, started once (spawn) and reused by many tests.

``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank (``fn`` must be importable: a module-level
function in ``tests/cases.py``) and returns the per-rank results, or raises with every failing
rank's traceback.
"""
from __future__ import annotations

import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout_s: float, inq, outq) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args = item
        try:
            outq.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            outq.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, timeout_s: float = 120.0):
        ctx = mp.get_context("spawn")
        self.world = world
        self.inq = [ctx.Queue() for _ in range(world)]
        self.outq = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, timeout_s, self.inq[r], self.outq), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = float(os.environ.get("AUTOSP_TEST_TIMEOUT", 600))) -> list:
        for q in self.inq:
            q.put((fn, args))
        results, errors = [None] * self.world, []
        for _ in range(self.world):
            try:
                rank, ok, value = self.outq.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"pool of {self.world}: no answer within {timeout} s") from None
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise RuntimeError("worker failure:\n" + "\n".join(errors))
        return results

    def close(self) -> None:
        for q in self.inq:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
