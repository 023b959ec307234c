"""Attention on a query shard against gathered K/V: for heads that cannot be split over the ranks.

A rank holds query rows ``start .. start + Sq`` of the global sequence and all of K and V. With
a causal mask its rows see every key before ``start`` and a causal diagonal block at
``start .. start + Sq``; keys after that are masked for all of them. Each part runs as the CPU
flash kernel and the parts are merged by their log-sum-exps. The backward runs the kernel's
backward per part with the merged output and log-sum-exp (the blockwise gradient of ring
attention: exact, each part's probabilities are the global softmax restricted to its keys); the
K/V gradients are this rank's partial sums, reduced over the ranks by the plan.
"""
from __future__ import annotations

import torch

__all__ = ["kv_gathered_attention", "kv_gathered_attention_backward"]

aten = torch.ops.aten


def _parts(start: int, sq: int, sk: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(first key, last key + 1, causal) of each key block the query rows see."""
    if not causal:
        return [(0, sk, False)]
    return ([(0, start, False)] if start > 0 else []) + [(start, start + sq, True)]


def kv_gathered_attention(q, k, v, start: int, is_causal: bool, scale=None):
    """(out, logsumexp) of ``_scaled_dot_product_flash_attention_for_cpu`` for query rows
    ``start ..`` of the sequence, with K and V whole."""
    sq = q.shape[2]
    if sq == 0:  # a rank without tokens (the kernel divides by the row count)
        return q.new_zeros(q.shape[:3] + v.shape[3:]), q.new_zeros(q.shape[:3], dtype=torch.float32 if q.dtype in (
            torch.bfloat16, torch.float16) else q.dtype)
    outs = [aten._scaled_dot_product_flash_attention_for_cpu(q, k[:, :, a:b], v[:, :, a:b], 0.0, c, scale=scale)[:2]
            for a, b, c in _parts(start, sq, k.shape[2], is_causal)]
    if len(outs) == 1:
        return outs[0]
    lse = torch.logaddexp(outs[0][1], outs[1][1])
    # merged in fp32 (the kernel accumulates in fp32 too), rounded once
    out = sum(o.float() * torch.exp(l - lse).unsqueeze(-1).float() for o, l in outs)
    return out.to(q.dtype), lse


def kv_gathered_attention_backward(grad_out, q, k, v, out, lse, start: int, is_causal: bool, scale=None):
    """(grad q, grad k, grad v): grad q for this rank's rows, grad k and v partial (this rank's
    rows' contribution to every key)."""
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq = torch.zeros_like(q)
    if q.shape[2] == 0:
        return dq, dk, dv
    for a, b, c in _parts(start, q.shape[2], k.shape[2], is_causal):
        gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k[:, :, a:b], v[:, :, a:b], out, lse, 0.0, c, scale=scale)
        dq = dq + gq
        dk = dk.slice_scatter(gk, 2, a, b) if (a, b) != (0, k.shape[2]) else gk
        dv = dv.slice_scatter(gv, 2, a, b) if (a, b) != (0, k.shape[2]) else gv
    return dq, dk, dv
