"""``benchmarks.run --lengths N``: N training steps whose lengths are drawn from a supervised
fine-tuning distribution (lognormal between 64 and 4096 tokens, median 512, not rounded to any
multiple), on one autosp step with symbolic lengths (the default, ``dynamic=True``), against
fixed-length training at one length (``--seqs``, default 1024) compiled as before (``dynamic=False``)
and symbolic, side by side in the same processes.

Measured per run: Dynamo's compile count (its own counter), the compile time (the wall time of
the steps that compiled, less the median step of those that did not), steps/s and tokens/s over
all N steps; every ``CHECK_EVERY``-th step the loss and gradients against one device at the same
parameters (the model's copied into a reference, in the same process); at the fixed length the
median step time of each compile (interleaved) and the bytes gloo/NCCL sent in one step
(torch.profiler's collective events). Compile times are a first run's: ``run_config`` gives the
run an empty Inductor cache (a warm one turns most of a compile into cache hits).
"""

from __future__ import annotations

import copy
import math
import random
import statistics
import time

import torch

__all__ = ["draw_lengths", "measure_lengths", "CHECK_EVERY"]

CHECK_EVERY = 20
LOW, HIGH, MEDIAN = 64, 4096, 512


def draw_lengths(steps: int, seed: int = 0, low: int = LOW, high: int = HIGH) -> list[int]:
    """``steps`` lengths, lognormal with median ``MEDIAN`` and ``low``/``high`` at 2.5 sigma, clipped."""
    rng = random.Random(seed)
    sigma = math.log(high / MEDIAN) / 2.5
    return [min(high, max(low, round(rng.lognormvariate(math.log(MEDIAN), sigma)))) for _ in range(steps)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _batch(vocab: int, L: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, L), generator=g)
    return ids.to(device), torch.randint(0, vocab, (1, L), generator=g).to(device)


def _timed(fn, device: str, *args) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def measure_lengths(model, cfg: dict, comm_bytes) -> dict:
    """The record of one rank (see the module docstring); ``comm_bytes(prof)``: the bytes a
    profiled step sent."""
    import autosp

    device, vocab = cfg["device"], model.c.vocab
    lengths = draw_lengths(cfg["lengths"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = copy.deepcopy(model)
    step = autosp.shard(lambda ids, labels: model(ids, labels), compiler=cfg["compiler"])

    losses = []

    def train(ids, labels):
        losses.append(step(ids, labels))
        losses[-1].backward()

    times, compiled, loss_err, grad_err = [], [], 0.0, 0.0
    for i, L in enumerate(lengths):
        ids, labels = _batch(vocab, L, i, device)
        before = _graphs()
        times.append(_timed(train, device, ids, labels))
        compiled.append(_graphs() > before)
        loss = losses.pop()
        if i % CHECK_EVERY == 0:  # one device at the same parameters (before the update)
            ref.load_state_dict(model.state_dict())
            ref.zero_grad()
            loss_ref = ref(ids, labels)
            loss_ref.backward()
            loss_err = max(loss_err, abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
            grad_err = max(grad_err, *(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())))
        opt.step()
        opt.zero_grad()
    steady = statistics.median(t for t, c in zip(times, compiled) if not c)
    total = sum(times)

    # fixed length: the static compile (as before symbolic lengths) against the symbolic one
    L0 = cfg["seq"]
    ids, labels = _batch(vocab, L0, -1, device)
    static = autosp.shard(lambda ids, labels: model(ids, labels), compiler=cfg["compiler"], dynamic=False)
    fixed = {"static": static, "symbolic": step}

    def once(s):
        s(ids, labels).backward()

    first = {k: _timed(once, device, s) for k, s in fixed.items()}
    runs = {k: [] for k in fixed}
    for _ in range(cfg["steps"]):
        for k, s in fixed.items():
            runs[k].append(_timed(once, device, s))
    comm = {}
    for k, s in fixed.items():
        with torch.profiler.profile(record_shapes=True) as prof:
            s(ids, labels).backward()
        comm[k] = comm_bytes(prof)
    model.zero_grad()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return dict(
        lengths=dict(
            n=len(lengths),
            distinct=len(set(lengths)),
            min=min(lengths),
            median=statistics.median(lengths),
            max=max(lengths),
            tokens=sum(lengths),
        ),
        compiles=sum(compiled),
        compile_time_s=sum(t - steady for t, c in zip(times, compiled) if c),
        first_compile_s=times[0] - steady,
        total_s=total,
        steps_per_s=len(lengths) / total,
        tokens_per_s=sum(lengths) / total,
        steady_steps_per_s=sum(not c for c in compiled) / sum(t for t, c in zip(times, compiled) if not c),
        checks=len(range(0, len(lengths), CHECK_EVERY)),
        loss_rel_err=loss_err,
        grad_rel_err=grad_err,
        fixed_seq=L0,
        fixed_step_s=med,
        fixed_ratio=med["symbolic"] / med["static"],
        fixed_compile_s={k: first[k] - med[k] for k in fixed},
        fixed_comm_bytes=comm,
        error=None,
    )
