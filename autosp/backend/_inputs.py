"""The step's inputs, checked across the sp group: every rank of a group must be called with the
same full inputs (with dp > 1, its dp replica's batch). Different inputs inside a group pass
every compile-time check (the shapes, hence the plans, agree) and would train on silently wrong
gradients: the commonest cause is a ``DistributedSampler`` over every rank instead of over the dp
replicas.

Each step, each rank fingerprints its tensor inputs (their bytes, summed plainly and weighted by
position, in exact integer arithmetic: equal on every rank for equal inputs whatever the
threads) and the sp group all-gathers the fingerprints; a mismatch is the same error on every
rank. ``autosp.shard(check_inputs=False)`` turns it off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import PlanError, collective_error, peer_lost

__all__ = ["check_same_inputs"]


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """(numel, byte sum, position-weighted byte sum) of a tensor, int64 (wrapping: exact)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(b.numel(), dtype=torch.int64) % 65521 + 1
    return torch.stack([torch.tensor(t.numel()), b.sum(), (b * w).sum()])


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(out, t)
    except RuntimeError as e:  # the first rendezvous of a step: a rank that never comes times it out
        if peer_lost(e):  # or a rank that stopped: its connection is gone
            raise collective_error(e) from None
        raise PlanError(
            None,
            f"not every rank called this step within the mesh's timeout ({str(e).strip().splitlines()[0][:200]})",
            "call the sharded step on every rank, with the same arguments on the ranks of an sp group",
        ) from e
    return out


def check_same_inputs(named: list[tuple[str, torch.Tensor]], groups: list[list[int]]) -> None:
    """Raise on every rank unless, in each of the sp ``groups`` (global ranks), every rank holds
    the same ``named`` tensors. The fingerprints go to every rank (not only the group's), so
    that a mismatch in one group stops the others too, instead of leaving them waiting for it in
    the gradients' all-reduce over dp."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mine = torch.stack([_fingerprint(t.cpu()) for _, t in named]) if named else torch.zeros(0, 3, dtype=torch.int64)
    counts = _all_gather(torch.tensor([len(named)], device=device))
    if len({int(c) for c in counts}) != 1:
        differ = {"number of tensor inputs": sorted({int(c) for c in counts})}
    else:
        every = _all_gather(mine.to(device))
        differ = {}
        for g in groups:
            names = [
                name
                for i, (name, _) in enumerate(named)
                if any(not torch.equal(every[r][i], every[g[0]][i]) for r in g)
            ]
            if names:
                differ[tuple(g)] = names
    if differ:
        what = "; ".join(
            f"sp group {list(g)}: {names}" if isinstance(g, tuple) else f"{g}: {names}" for g, names in differ.items()
        )
        raise PlanError(
            None,
            f"the ranks of an sp group were called with different inputs ({what} differ between its ranks); "
            "each rank would train on its own data under a plan that assumes one sequence split over them",
            "give every rank of an sp group the same full batch: with dp > 1 each dp replica's batch, from a "
            "sampler over the dp replicas only (DistributedSampler(dataset, num_replicas=mesh.dp_size, "
            "rank=mesh.dp_rank)), not over every rank; or pass autosp.shard(check_inputs=False) to skip this check",
        )
