"""CPU reference implementations of CUDA's attention kernels, registered for the CPU dispatch key
(importing this module registers them), so that a step captured with the kernels a GPU runs
(``autosp._attention_ops.gpu_attention``) runs here: on gloo ranks, and on one process as the
reference. Same schemas and outputs as the CUDA kernels, log-sum-exp included, each output in the
layout torch's meta function gives it (Inductor plans with those strides); the math is the CPU
flash kernel's, which takes grouped-query K/V as CUDA's flash kernel does. Without dropout only:
the CUDA kernels draw their own masks, which no CPU kernel can reproduce."""

from __future__ import annotations

import torch

aten = torch.ops.aten
_LIB = torch.library.Library("aten", "IMPL")


def _like(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in the layout of ``empty_like(x)``."""
    return torch.empty_like(x).copy_(value)


def _flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert dropout_p == 0.0, "the CPU reference of CUDA flash runs without dropout"
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)
    return (
        _like(query, out) if value.shape[-1] == query.shape[-1] else out.contiguous(),
        lse.contiguous(),
        None,
        None,
        query.shape[2],
        key.shape[2],
        torch.zeros(2, dtype=torch.uint64),
        torch.zeros((), dtype=torch.uint64),
        query.new_empty(0),
    )


def _flash_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    assert dropout_p == 0.0, "the CPU reference of CUDA flash runs without dropout"
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale
    )
    return _like(query, dq), _like(key, dk), _like(value, dv)


def _heads_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` (B, H, L, D) laid out as (B, L, H, D), as the memory-efficient kernel's meta makes
    its output and gradients."""
    B, H, L, D = x.shape
    return x.new_empty(B, L, H, D).transpose(1, 2).copy_(x)


def _efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    assert dropout_p == 0.0, "the CPU reference of CUDA's memory-efficient kernel runs without dropout"
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )
    L = query.shape[2]
    lse = torch.nn.functional.pad(lse, (0, -L % 32)) if compute_log_sumexp else lse[..., :0]
    zero = torch.zeros((), dtype=torch.int64)
    return _heads_layout(out), lse.contiguous(), zero, zero.clone()


def _efficient_backward(
    grad_out_,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    assert dropout_p == 0.0 and not grad_input_mask[3], "no dropout, no bias gradient"
    lse = logsumexp[..., : query.shape[2]].contiguous()
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out_, query, key, value, out, lse, 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )
    return _heads_layout(dq), _heads_layout(dk), _heads_layout(dv), None


def _cudnn(
    query,
    key,
    value,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    assert dropout_p == 0.0, "the CPU reference of cuDNN's kernel runs without dropout"
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )
    zero = torch.zeros((), dtype=torch.int64)
    out = _like(query, out) if value.shape[-1] == query.shape[-1] else out.contiguous()
    return out, lse.unsqueeze(-1).contiguous(), None, None, query.shape[2], key.shape[2], zero, zero.clone(), None


def _cudnn_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    assert dropout_p == 0.0, "the CPU reference of cuDNN's kernel runs without dropout"
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp.squeeze(-1), 0.0, is_causal, attn_mask=attn_bias, scale=scale
    )
    return _like(query, dq), _like(key, dk), _like(value, dv)


_LIB.impl("_scaled_dot_product_flash_attention", _flash, "CPU")
_LIB.impl("_scaled_dot_product_cudnn_attention", _cudnn, "CPU")
_LIB.impl("_scaled_dot_product_cudnn_attention_backward", _cudnn_backward, "CPU")
_LIB.impl("_scaled_dot_product_efficient_attention", _efficient, "CPU")
_LIB.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward, "CPU")
_LIB.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "CPU")
