"""The attention kernels autosp plans: one record per kernel (``AttentionOp``) holding everything
the passes read of it, keyed by its forward and backward op overloads (``ATTENTION``). The sharding
rules (``propagate._attention``), the per-rank calls (``partition._attention``), the K/V-repeat
passes (``partition._gqa``), FLOPs and the plan's notes read a kernel through its record, its
arguments by schema name, never by position: adding a kernel is one record here.

Four kernels: the CPU flash kernel SDPA runs on CPU, CUDA's flash kernel (what SDPA runs on an
H100 for bf16 or fp16 without a mask), CUDA's memory-efficient kernel (fp32, or a mask; its
log-sum-exp's rows padded to a multiple of 32) and cuDNN's (forced only). ``gpu_attention``
routes ``F.scaled_dot_product_attention`` to a kernel of this table while a step is traced
(``autosp.explain(..., device="h100")``), so the plan is made for the graph that GPU runs, on any
machine. A leaf: it imports nothing from autosp.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "AttentionOp",
    "ATTENTION",
    "FORWARDS",
    "BY_NAME",
    "GPU_KERNELS",
    "CPU_FLASH",
    "CUDA_FLASH",
    "EFFICIENT",
    "CUDNN",
    "attention_op",
    "input_names",
    "call_grouped",
    "padded_lse",
    "gpu_attention",
    "gpu_kernel",
]

aten = torch.ops.aten


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionOp:
    """One attention kernel, forward and backward, as autosp reads it.

    name: what ``explain`` calls it, e.g. ``"CUDA flash"``.
    mask: the forward's and backward's mask (or bias) argument, None where the kernel takes none.
    lse: the forward's log-sum-exp output, (B, H, S) like its output's first three dims.
    lse_rows: the log-sum-exp's rows are padded to a multiple of this (the memory-efficient
        kernel's 32): its rows then do not split as the sequence does, and a plan must never move
        it between placements (``partition._localize`` refuses to).
    grad_out: the backward's incoming-gradient argument.
    gqa: the kernel takes fewer K/V heads than query heads itself (query head j reads K/V head
        j // (H / KV)), so K/V repeats may be folded into it (``partition._gqa``).
    draws: the kernel draws its own dropout mask (dropout then cannot be split exactly).
    run / run_backward: the kernel on one block of this rank's rows, without dropout:
        ``run(q, k, v, is_causal, mask, scale) -> (out, lse)`` and
        ``run_backward(grad_out, q, k, v, out, lse, is_causal, mask, scale) -> (dq, dk, dv)``.
    outputs: the forward's whole output tuple from (out, lse, q, k), for a per-rank call that
        computes only those two (ring attention): the other outputs as the kernel makes them
        without dropout.
    """

    name: str
    forward: torch._ops.OpOverload
    backward: torch._ops.OpOverload
    mask: str | None
    lse: int = 1
    lse_rows: int = 1
    grad_out: str = "grad_out"
    gqa: bool = True
    draws: bool = False
    run: Callable
    run_backward: Callable
    outputs: Callable = lambda out, lse, q, k: (out, lse)

    def forward_outs(self, node: fx.Node, p, other) -> tuple:
        """The forward's output placements: ``p`` for its output and log-sum-exp, ``other`` for
        its other tensor outputs (the RNG state), None for non-tensor ones (sizes)."""
        vals = node.meta["val"]
        return tuple(
            (p if i in (0, self.lse) else other) if isinstance(v, torch.Tensor) else None for i, v in enumerate(vals)
        )

    def backward_outs(self, node: fx.Node, p) -> tuple:
        """The backward's output placements: ``p`` for each gradient."""
        return tuple(p if isinstance(v, torch.Tensor) else None for v in node.meta["val"])


def _cpu_run(q, k, v, is_causal, mask, scale):
    return tuple(aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale))


def _cpu_run_backward(grad_out, q, k, v, out, lse, is_causal, mask, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )


CPU_FLASH = AttentionOp(
    name="CPU flash",
    forward=aten._scaled_dot_product_flash_attention_for_cpu.default,
    backward=aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    mask="attn_mask",
    run=_cpu_run,
    run_backward=_cpu_run_backward,
)


def _flash_run(q, k, v, is_causal, mask, scale):
    assert mask is None, "CUDA flash takes no mask"
    return tuple(aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)[:2])


def _rng_state(q):
    """The (philox seed and offset) flash returns; without dropout nothing reads them."""
    return q.new_zeros((2,), dtype=torch.uint64), q.new_zeros((), dtype=torch.uint64)


def _flash_run_backward(grad_out, q, k, v, out, lse, is_causal, mask, scale):
    assert mask is None, "CUDA flash takes no mask"
    seed, offset = _rng_state(q)
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, is_causal, seed, offset, scale=scale
    )


def _flash_outputs(out, lse, q, k):
    seed, offset = _rng_state(q)
    return (out, lse, None, None, q.shape[2], k.shape[2], seed, offset, q.new_empty((0,)))


CUDA_FLASH = AttentionOp(
    name="CUDA flash",
    forward=aten._scaled_dot_product_flash_attention.default,
    backward=aten._scaled_dot_product_flash_attention_backward.default,
    mask=None,
    draws=True,
    run=_flash_run,
    run_backward=_flash_run_backward,
    outputs=_flash_outputs,
)


def _philox(q):
    """The (seed, offset) the memory-efficient and cuDNN kernels return; without dropout nothing
    reads them."""
    return q.new_zeros((), dtype=torch.int64), q.new_zeros((), dtype=torch.int64)


def _padded(lse, rows: int):
    """A log-sum-exp's rows padded to a multiple of 32, as the memory-efficient kernel lays it out."""
    return torch.nn.functional.pad(lse, (0, -rows % 32))


def _aligned(bias):
    """The bias as SDPA hands it to the memory-efficient kernel: copied into rows padded to a
    multiple of 16 elements, so that its start and its row stride are aligned as the kernel
    checks them (a ring block's columns, narrowed from the mask, start anywhere and keep the
    whole row's stride). Always copied: a test of the stride on a symbolic length would guard
    the compile on the length modulo 16."""
    if bias is None:
        return bias
    return torch.nn.functional.pad(bias, (0, -bias.shape[-1] % 16))[..., : bias.shape[-1]]


def _efficient_run(q, k, v, is_causal, mask, scale):
    forward = aten._scaled_dot_product_efficient_attention.default
    out, lse = call_grouped(forward, q, k, v, _aligned(mask), True, 0.0, is_causal, scale=scale)[:2]
    return out, lse[..., : q.shape[2]]


def _efficient_run_backward(grad_out, q, k, v, out, lse, is_causal, mask, scale):
    seed, offset = _philox(q)
    return call_grouped(
        aten._scaled_dot_product_efficient_attention_backward.default,
        grad_out,
        q,
        k,
        v,
        _aligned(mask),
        out,
        _padded(lse, q.shape[2]),
        seed,
        offset,
        0.0,
        [True, True, True, False],
        is_causal,
        scale=scale,
    )[:3]


def _efficient_outputs(out, lse, q, k):
    return (out, _padded(lse, q.shape[2]), *_philox(q))


# the kernel SDPA runs on a GPU for fp32, and for any dtype with a mask (a bool mask becomes an
# additive bias first): Hugging Face's SDPA path under torch.compile always passes one
EFFICIENT = AttentionOp(
    name="CUDA memory-efficient",
    forward=aten._scaled_dot_product_efficient_attention.default,
    backward=aten._scaled_dot_product_efficient_attention_backward.default,
    mask="attn_bias",
    lse_rows=32,
    grad_out="grad_out_",
    gqa=False,
    draws=True,
    run=_efficient_run,
    run_backward=_efficient_run_backward,
    outputs=_efficient_outputs,
)


def _cudnn_run(q, k, v, is_causal, mask, scale):
    forward = aten._scaled_dot_product_cudnn_attention.default
    out, lse = call_grouped(forward, q, k, v, mask, True, 0.0, is_causal, False, scale=scale)[:2]
    return out, lse.squeeze(-1)


def _cudnn_run_backward(grad_out, q, k, v, out, lse, is_causal, mask, scale):
    seed, offset = _philox(q)
    backward = aten._scaled_dot_product_cudnn_attention_backward.default
    return call_grouped(
        backward,
        grad_out,
        q,
        k,
        v,
        out,
        lse.unsqueeze(-1),
        seed,
        offset,
        mask,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        is_causal,
        scale=scale,
    )[:3]


def _cudnn_outputs(out, lse, q, k):
    seed, offset = _philox(q)
    return (out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], seed, offset, None)


# the kernel some torch builds put first on sm90 and later with a recent cuDNN (not picked by
# ``gpu_kernel``: force it with attention_kernel="cudnn"); its log-sum-exp is (B, H, S, 1)
CUDNN = AttentionOp(
    name="CUDA cuDNN",
    forward=aten._scaled_dot_product_cudnn_attention.default,
    backward=aten._scaled_dot_product_cudnn_attention_backward.default,
    mask="attn_bias",
    gqa=False,
    draws=True,
    run=_cudnn_run,
    run_backward=_cudnn_run_backward,
    outputs=_cudnn_outputs,
)

# forward or backward op -> its kernel's record
ATTENTION: dict[object, AttentionOp] = {
    op: k for k in (CPU_FLASH, CUDA_FLASH, EFFICIENT, CUDNN) for op in (k.forward, k.backward)
}
FORWARDS = frozenset(k.forward for k in ATTENTION.values())
BY_NAME = {k.name: k for k in ATTENTION.values()}  # how a per-rank custom op names its kernel
# the names ``attention_kernel=`` accepts: the GPU kernels SDPA may pick
GPU_KERNELS = {"flash": CUDA_FLASH, "efficient": EFFICIENT, "cudnn": CUDNN}


def attention_op(target) -> AttentionOp | None:
    """The record of an attention forward or backward op (None for any other target)."""
    return ATTENTION.get(target)


def padded_lse(u: fx.Node, i: int) -> AttentionOp | None:
    """The kernel whose log-sum-exp, its rows padded (``AttentionOp.lse_rows``), output i of u is
    (directly, or through the getitem of it), else None: no collective may move it."""
    if u.target is operator.getitem:
        u, i = u.args[0], u.args[1]
    op = attention_op(u.target)
    return op if op is not None and u.target is op.forward and i == op.lse and op.lse_rows > 1 else None


def input_names(node: fx.Node) -> list[str]:
    """The schema name of each tensor input of ``node``, in ``_graph.tensor_inputs`` order (its
    positional arguments, then its keyword arguments, each flattened)."""
    schema = node.target._schema
    names = []
    pairs = [(schema.arguments[i].name, a) for i, a in enumerate(node.args)] + list(node.kwargs.items())
    for name, a in pairs:
        leaves, _ = tree_flatten(a)
        names += [name for x in leaves if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]
    return names


def call_grouped(target, *args, **kwargs):
    """``target`` (a forward or backward of the table) with K/V of fewer heads than the query's:
    as it is where the kernel takes them (``gqa``), else on K/V repeated to the query's heads
    (query head j reads K/V head j // rep, as Hugging Face's ``repeat_kv`` lays them out), the K/V
    gradients summed back over the copies. Every kernel takes query, key and value first, and its
    backward them after the incoming gradient."""
    op = ATTENTION[target]
    at = 1 if target is op.backward else 0
    q, k, v = args[at : at + 3]
    rep = q.shape[1] // k.shape[1]
    if op.gqa or rep == 1:
        return target(*args, **kwargs)
    repeated = tuple(x.repeat_interleave(rep, 1) for x in (k, v))
    out = target(*args[: at + 1], *repeated, *args[at + 3 :], **kwargs)
    if target is op.forward:
        return out
    out = list(out)
    for i, x in ((1, k), (2, v)):
        out[i] = out[i].unflatten(1, (x.shape[1], rep)).sum(2)
    return tuple(out)


def gpu_kernel(
    dtype: torch.dtype,
    has_mask: bool,
    head_dim: int,
    forced: str | None = None,
    square: bool = True,
    grouped: bool = False,
) -> AttentionOp | None:
    """The kernel SDPA runs on a recent NVIDIA GPU (sm80 and later: A100, H100, H200, B200) for
    these inputs, in torch's default order (flash, then memory-efficient, then math): flash for
    fp16 and bf16 without a mask, head dims up to 256 (SDPA pads them to 8) and, under a causal
    mask, as many queries as keys (``square``); else the memory-efficient kernel (fp32, or a
    mask) for head dims in multiples of 4 (fp32) or 8, K/V heads as many as the query's (not
    ``grouped``); else None: SDPA's math fallback, whose ops are planned one by one. Not
    modelled: torch builds that put cuDNN's kernel first on sm90 and later with a recent cuDNN
    (force "cudnn" to plan it). ``forced``: one of ``GPU_KERNELS``, as
    ``torch.nn.attention.sdpa_kernel`` would force it (an error where it cannot run)."""
    if forced is not None:
        if forced not in GPU_KERNELS:
            raise ValueError(f"autosp: attention_kernel={forced!r}; use one of {sorted(GPU_KERNELS)}")
        op = GPU_KERNELS[forced]
        if grouped and not op.gqa:
            raise NotImplementedError(
                f"autosp: attention_kernel={forced!r} with grouped K/V heads (enable_gqa): the {op.name} kernel "
                "takes none; repeat K/V before attention, or force 'flash'"
            )
        return op
    half = dtype in (torch.float16, torch.bfloat16)
    if half and not has_mask and head_dim <= 256 and square:
        return CUDA_FLASH
    if ((half and head_dim % 8 == 0) or (dtype == torch.float32 and head_dim % 4 == 0)) and not grouped:
        return EFFICIENT
    return None


class gpu_attention(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs as the GPU kernel ``gpu_kernel``
    picks (or ``forced``), on whatever device the tensors are: a step traced under it has that
    kernel's forward and backward ops in its graph, as on the GPU. Tracing on fake CUDA tensors
    instead is not possible with a CPU build of torch: autograd on a CUDA tensor asks for CUDA's
    device guard and aborts the process (torch 2.13). Running the traced step needs the kernel
    on the tensors' device (on CPU, a reference the tests register)."""

    def __init__(self, forced: str | None = None):
        super().__init__()
        self.forced = forced

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return _sdpa_as(self.forced, *args, **kwargs)


def _sdpa_as(forced, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    grouped = key.shape[-3] != query.shape[-3]
    if grouped and not enable_gqa:
        raise ValueError(
            f"autosp: {query.shape[-3]} query heads and {key.shape[-3]} K/V heads need enable_gqa=True, as in SDPA"
        )
    square = not is_causal or query.shape[-2] == key.shape[-2]
    op = gpu_kernel(query.dtype, attn_mask is not None, query.shape[-1], forced, square, grouped)
    if op is None:  # SDPA's math fallback: its ops, planned one by one as on CPU
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]
    if op is CUDA_FLASH:
        if attn_mask is not None:
            raise NotImplementedError("autosp: CUDA's flash kernel takes no mask; force attention_kernel='efficient'")
        return op.forward(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # SDPA's conversion to an additive bias
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if op is CUDNN:
        return op.forward(query, key, value, attn_mask, logsumexp, dropout_p, is_causal, False, scale=scale)[0]
    return op.forward(query, key, value, attn_mask, logsumexp, dropout_p, is_causal, scale=scale)[0]
