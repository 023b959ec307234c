"""Hand-written DeepSpeed-Ulysses for ``examples.models.Llama``: the baseline autosp is measured
against, written as a user would write it by hand.

Each rank takes its contiguous slice of the sequence; positions are global; per layer, q, k and v
are all-to-all'd from sequence-sharded to head-sharded (k/v at their own head count when it
divides the sp size), attention runs on all tokens for H/N heads, and the output is all-to-all'd
back. The loss is token-weighted: local sum of the per-token losses over the global count of
valid tokens; gradients are summed over the sp group afterwards (``allreduce_grads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
import torch.utils.checkpoint

from .models import Llama, _causal_attention, _rope, _rotate_half

__all__ = ["ulysses_loss", "allreduce_grads"]


def _seq_to_heads(x, group, n):
    """(b, s/n, h, d) -> (b, s, h/n, d)."""
    b, s, h, d = x.shape
    y = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    y = funcol.all_to_all_single_autograd(y, None, None, group)
    return y.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _heads_to_seq(x, group, n):
    """(b, s, h/n, d) -> (b, s/n, h, d)."""
    b, s, h, d = x.shape
    y = x.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4).contiguous()
    y = funcol.all_to_all_single_autograd(y, None, None, group)
    return y.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def _attention(attn, x, cos, sin, group, n):
    b, t, _ = x.shape
    c = attn.c
    q = attn.q_proj(x).view(b, t, c.heads, attn.hd)
    k = attn.k_proj(x).view(b, t, c.kv_heads, attn.hd)
    v = attn.v_proj(x).view(b, t, c.kv_heads, attn.hd)
    cos, sin = cos[:, :, None], sin[:, :, None]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    if c.kv_heads % n:  # too few kv heads to split: replicate them first (as ALST does)
        k = k.repeat_interleave(c.heads // c.kv_heads, dim=2)
        v = v.repeat_interleave(c.heads // c.kv_heads, dim=2)
    q, k, v = (_seq_to_heads(z, group, n).transpose(1, 2) for z in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and c.attn != "gqa":
        k, v = (z.repeat_interleave(rep, dim=1) for z in (k, v))
    o = _causal_attention(q, k, v, c.attn).transpose(1, 2)
    o = _heads_to_seq(o, group, n)
    return attn.o_proj(o.reshape(b, t, c.heads * attn.hd))


def _layer(blk, x, cos, sin, group, n):
    x = x + _attention(blk.attn, blk.attn_norm(x), cos, sin, group, n)
    h = blk.mlp_norm(x)
    return x + blk.down(F.silu(blk.gate(h)) * blk.up(h))


def ulysses_loss(model: Llama, input_ids, labels, group=None, checkpoint: bool = False):
    """Returns (local_loss, global_loss): backprop ``local_loss`` (local token-loss sum over the
    global valid-token count), then ``allreduce_grads``; ``global_loss`` is the value to log.
    ``checkpoint``: per-layer ``torch.utils.checkpoint`` (each layer recomputed in the backward),
    as Megatron's and DeepSpeed's full activation checkpointing, its all-to-alls included: the
    partitioner recomputes collectives inside a user's checkpoint region (torch 2.13,
    ``force_save_collectives`` skips nodes the region tags), and measured, it keeps 33 MiB where
    autosp's "full" keeps 51 (benchmarks/memory.py, 2048 tokens over 2)."""
    group = group or dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    b, s = input_ids.shape
    c = s // n
    sl = slice(r * c, (r + 1) * c)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]  # shift before slicing: crosses shards
    ids, tgt = input_ids[:, sl], shifted[:, sl]
    positions = torch.arange(r * c, (r + 1) * c, device=ids.device)[None].expand(b, c)
    cos, sin = _rope(positions, model.c.dim // model.c.heads, model.c.rope_theta, model.embed.weight.dtype)
    x = model.embed(ids)
    for blk in model.blocks:
        if checkpoint:
            x = torch.utils.checkpoint.checkpoint(_layer, blk, x, cos, sin, group, n, use_reentrant=False)
        else:
            x = _layer(blk, x, cos, sin, group, n)
    logits = model.lm_head(model.norm(x)).float()
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100, reduction="sum")
    stats = torch.stack([total.detach(), (tgt != -100).sum().to(total.dtype)])
    dist.all_reduce(stats, group=group)
    return total / stats[1], stats[0] / stats[1]


def allreduce_grads(model: torch.nn.Module, group=None) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
