"""The systems compared, each as a factory of one training step on the same model and batch.

A factory gets (model, input_ids, labels, mesh) and returns a zero-argument callable that runs
forward and backward and returns the loss as a float (gradients summed over the sp group where
the system leaves that to the user).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import autosp
from examples.ulysses import allreduce_grads, ulysses_loss

__all__ = ["SYSTEMS"]


def single(model, ids, labels, mesh, compiler):
    step = torch.compile(lambda i, y: model(i, y), backend=compiler, fullgraph=True)

    def run():
        loss = step(ids, labels)
        loss.backward()
        return loss.item()

    return run


def _ulysses(compiled: bool):
    def factory(model, ids, labels, mesh, compiler):
        group = mesh.sp_group
        fn = (
            (lambda i, y: ulysses_loss(model, i, y, group))
            if not compiled
            else torch.compile(lambda i, y: ulysses_loss(model, i, y, group), backend=compiler)
        )

        def run():
            local, loss = fn(ids, labels)
            local.backward()
            allreduce_grads(model, group)
            return loss.item()

        return run

    return factory


def dtensor(model, ids, labels, mesh, compiler):
    """Plain DTensor: parameters replicated, inputs sharded along the sequence, DTensor's greedy
    per-op propagation in eager mode."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    sp = mesh.sp_mesh
    distribute_module(model, sp)  # parameters -> replicated DTensors
    dids = distribute_tensor(ids, sp, [Shard(1)])
    dlabels = distribute_tensor(labels, sp, [Shard(1)])

    def run():
        loss = model(dids, dlabels)
        loss.backward()
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    return run


def context_parallel(model, ids, labels, mesh, compiler):
    """torch's ring attention: inputs sharded in place along the sequence inside the context
    manager; SDPA calls become ring attention."""
    from torch.distributed.tensor.experimental import context_parallel as cp

    sp = mesh.sp_mesh
    buf_ids, buf_labels = ids.clone(), labels.clone()

    def run():
        with cp(sp, buffers=[buf_ids, buf_labels], buffer_seq_dims=[1, 1]):
            loss = model(buf_ids, buf_labels)
            loss.backward()
        allreduce_grads(model, mesh.sp_group)
        return loss.item()

    return run


def _autosp(attention: str):
    """autosp with its attention kernel chosen by cost ("auto") or forced ("ring", "kv_gather",
    "hybrid")."""

    def factory(model, ids, labels, mesh, compiler):
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler=compiler, attention=attention)

        def run():
            loss = step(ids, labels)
            loss.backward()
            return loss.item()

        return run

    return factory


def _autosp_adamw(fsdp: bool):
    """autosp with an AdamW step, the parameters plain (every rank holds all of them, their
    gradients and optimizer state) or sharded by FSDP2 over the sp ranks (``fully_shard`` per
    block and on the model: ZeRO-3). Gradients stay allocated between steps (zeroed, not freed),
    as DDP keeps its buckets."""

    def factory(model, ids, labels, mesh, compiler):
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block, mesh=mesh.sp_mesh)
            fully_shard(model, mesh=mesh.sp_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = autosp.shard(lambda input_ids, labels: model(input_ids, labels), compiler=compiler)

        def run():
            loss = step(ids, labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.item()

        run.optimizer = opt
        return run

    return factory


SYSTEMS: dict[str, Callable] = {
    "single": single,
    "ulysses_eager": _ulysses(False),
    "ulysses_compiled": _ulysses(True),
    "dtensor": dtensor,
    "context_parallel": context_parallel,
    "autosp": _autosp("auto"),
    "autosp_ring": _autosp("ring"),
    "autosp_kv_gather": _autosp("kv_gather"),
    "autosp_hybrid": _autosp("hybrid"),  # needs --ulysses (a 2D sp mesh)
    "autosp_adamw": _autosp_adamw(False),
    "autosp_fsdp": _autosp_adamw(True),
}
