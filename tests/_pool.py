"""A pool of worker processes (gloo on CPU; NCCL with one GPU per rank), started once (spawn) and
reused by many tests.

``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank (``fn`` must be importable: a module-level
function in ``tests/cases.py``) and returns the per-rank results, or raises with every failing
rank's traceback. A worker that dies, or a run that does not answer within the timeout, fails the
test with every rank's Python stack (faulthandler) and breaks the pool: the ``pools`` fixture starts
a fresh one for the next test, so one hang costs one test, not the rest of the suite.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout_s: float, stack_file: str, backend: str, inq, outq) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import datetime
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=True)  # noqa: SIM115
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        # the exactness tests compare fp32 at 1e-5 relative; TF32 (10-bit mantissa) cannot meet that
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    outq.put((rank, True, "ready"))
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args = item
        try:
            outq.put((rank, True, fn(*args)))
        except BaseException:
            outq.put((rank, False, traceback.format_exc()))
    if backend == "gloo":
        # nothing to flush, and destroy_process_group waits on the peers (about 20 s of the
        # suite's teardown on 2 cores): leave at once
        os._exit(0)
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, timeout_s: float = 120.0, backend: str = "gloo"):
        ctx = mp.get_context("spawn")
        self.world = world
        self.broken = False
        self.inq = [ctx.Queue() for _ in range(world)]
        self.outq = ctx.Queue()
        self.stack_dir = tempfile.mkdtemp(prefix=f"autosp-{backend}{world}-")
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(
                    r,
                    world,
                    port,
                    timeout_s,
                    os.path.join(self.stack_dir, f"rank{r}.txt"),
                    backend,
                    self.inq[r],
                    self.outq,
                ),
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self._collect(timeout=300.0, what="process group start")

    def run(self, fn, *args, timeout: float = float(os.environ.get("AUTOSP_TEST_TIMEOUT", 300))) -> list:
        for q in self.inq:
            q.put((fn, args))
        return self._collect(timeout, f"{getattr(fn, '__name__', fn)}{args!r}"[:200])

    def _collect(self, timeout: float, what: str) -> list:
        results, errors, answered = [None] * self.world, [], 0
        deadline = time.monotonic() + timeout
        while answered < self.world:
            try:
                rank, ok, value = self.outq.get(timeout=2.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:  # with what the others said meanwhile (a collective that lost its peer)
                    self._fail(
                        f"pool of {self.world}: worker(s) died (rank, exit code) {dead} during {what}"
                        + "".join("\n" + e for e in errors)
                    )
                if time.monotonic() > deadline:
                    self._fail(
                        f"pool of {self.world}: no answer within {timeout} s from {self.world - answered} "
                        f"rank(s) during {what}" + "".join("\n" + e for e in errors)
                    )
                continue
            answered += 1
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                # the other ranks may now wait forever in a collective: give them a short grace
                deadline = min(deadline, time.monotonic() + 30.0)
        if errors:
            raise RuntimeError("worker failure:\n" + "\n".join(errors))
        return results

    def _fail(self, message: str) -> None:
        """Dump every live rank's Python stack, kill the pool and raise with the stacks."""
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(2.0)
        stacks = []
        for r in range(self.world):
            path = os.path.join(self.stack_dir, f"rank{r}.txt")
            text = open(path).read() if os.path.exists(path) else ""  # noqa: SIM115
            stacks.append(f"--- rank {r} stack ---\n{text[-6000:]}")
        for p in self.procs:
            p.kill()
        raise TimeoutError(message + "\n" + "\n".join(stacks))

    def close(self) -> None:
        if not self.broken:
            for q in self.inq:
                q.put(None)
        for p in self.procs:
            # a worker's destroy_process_group can wait on its peers for long (a 2D mesh has more
            # groups): it has nothing to flush, so 5 s then kill (measured: a 31 s teardown)
            p.join(timeout=5 if not self.broken else 1)
            if p.is_alive():
                p.kill()
