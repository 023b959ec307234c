"""``autosp.shard``: mark a training step's inputs as sequence-sharded and compile it for the mesh;
``autosp.explain``: the plan of one call."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from .._attention_ops import gpu_attention
from .._context import Options
from .._devices import device as accelerator
from ..backend._fsdp import detach_forward_hooks
from ..backend._step import SeqSpec, ShardedStep
from ._mesh import current_mesh

__all__ = ["shard", "explain"]


def shard(fn: Callable | nn.Module | None = None, *, seq: SeqSpec = True, **options: Any):
    """Run ``fn`` (a training step returning a loss, or an ``nn.Module``) sequence-parallel on the
    current ``autosp.mesh``; as a decorator, ``@autosp.shard(seq=True, ...)``.

    seq: which inputs are sharded along their sequence dim: True (dim 1 of every tensor argument
        with ndim >= 2), an argument name or list of names (dim 1), or a mapping name -> dim;
        tensors inside dict, list and tuple arguments count, and a dict key is a name too.
    options: the fields of ``autosp.backend.Options``: ``compiler`` ("inductor" or "aot_eager"),
        ``checkpoint`` ("auto", "none", "full", or a budget in bytes per rank for the step's peak
        beyond parameters and optimizer state: the fastest plan predicted to fit, or an error
        naming the smallest budget that fits), ``attention`` ("auto", or one kernel forced:
        "ulysses", "ring", "kv_gather", "hybrid"; a forced kernel that cannot run an attention op
        exactly is an error), ``dynamic`` (True: the sequence lengths symbolic, one compile for
        every length; False: one per length), ``offload`` (True: also weigh checkpointing rungs
        whose saved layer activations are in host memory), ``blocks_once`` (True: alike repeated
        blocks traced once), ``mem_weight``, ``every_rung``, ``check_inputs``.
    Called with full, global tensors (identical on the ranks of an sp group); returns what one
    device would: the global loss on every rank, and after ``backward()`` every parameter's
    ``.grad`` is the single-device gradient on every rank. Under ``torch.no_grad()`` (evaluation)
    the step is planned forward-only: split the same way, without checkpointing or tiling.
    """
    opts = Options.of(**options)
    if fn is None:
        return functools.partial(shard, seq=seq, **options)
    if isinstance(fn, nn.Module):
        fn.forward = ShardedStep(fn.forward, seq, opts, current_mesh)
        detach_forward_hooks(fn)
        return fn
    return ShardedStep(fn, seq, opts, current_mesh)


def explain(fn, *args, device: str | None = None, attention_kernel: str | None = None, **kwargs):
    """The plan for one call of ``fn`` (made by ``autosp.shard``, or a module it wrapped): the
    placement of every node and every inserted collective with its bytes and source line.

    device: plan the graph that GPU runs, on any machine: one of ``autosp._devices.DEVICES``
        ("h100", "h200", "a100", "b200", "mi300x"), e.g. ``device="h100"``. Attention is traced as
        the kernel SDPA picks there for the inputs' dtype (CUDA flash for bf16 and fp16 without a
        mask); the tensors stay where they are (a CPU build of torch cannot run autograd on fake
        CUDA tensors). The kernel is named in the plan's notes, and the device's figures weigh the
        checkpointing pass's costs (``Options.device``).
    attention_kernel: force one GPU kernel ("flash" or "efficient"), as
        ``torch.nn.attention.sdpa_kernel`` does.
    """
    target = fn.forward if isinstance(fn, nn.Module) else fn
    if not isinstance(target, ShardedStep):
        target = ShardedStep(target, True, Options(compiler="aot_eager"), current_mesh)
    if device is None and attention_kernel is None:
        return target.explain(*args, **kwargs)
    if device is not None:  # its figures weigh the checkpointing pass's costs (``Options.device``)
        if accelerator(device).vendor != "nvidia":
            raise NotImplementedError(
                f"autosp: explain(device={device!r}): the attention kernels recorded are NVIDIA's (ROCm's differ: "
                "an unpadded log-sum-exp, other RNG outputs); name an NVIDIA device, or set Options.device for "
                "the checkpointing costs alone"
            )
        target = target.with_options(device=device)
    with gpu_attention(attention_kernel):
        return target.explain(*args, **kwargs)
