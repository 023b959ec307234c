"""Small decoder-only LMs for the examples and tests, written as single-device code.

``Llama``: RMSNorm, RoPE computed from positions, grouped-query attention (K/V repeated to the
query heads, as Hugging Face's ``repeat_kv``), SwiGLU, causal SDPA (or the same attention written
out: matmul, additive causal mask, softmax, matmul; or SDPA on the unrepeated K/V), the causal-LM
shift inside the model, cross-entropy with ignore_index.
``GPT``: learned absolute positions, tied input/output embeddings, LayerNorm with biases, GELU MLP,
attention written out by hand with ``masked_fill``; takes labels already shifted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaConfig", "Llama", "GPTConfig", "GPT"]


@dataclass(kw_only=True)
class LlamaConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    rope_theta: float = 10000.0
    attn: str = "sdpa"  # or "manual"; "gqa": SDPA with the K/V heads unrepeated (enable_gqa)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rope(positions, head_dim: int, theta: float, dtype: torch.dtype):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    freqs = positions[..., None].float() * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)  # computed in fp32, applied in the model's dtype


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _causal_attention(q, k, v, kind: str):
    if kind in ("sdpa", "gqa"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kind == "gqa")
    t = q.shape[-2]
    mask = torch.full((t, t), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask
    return scores.softmax(dim=-1) @ v


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c, self.hd = c, c.dim // c.heads
        self.q_proj = nn.Linear(c.dim, c.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(c.dim, c.kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(c.dim, c.kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(c.heads * self.hd, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.kv_heads, self.hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if c.attn != "gqa":
            rep = c.heads // c.kv_heads
            k = k[:, :, None].expand(b, c.kv_heads, rep, t, self.hd).reshape(b, c.heads, t, self.hd)
            v = v[:, :, None].expand(b, c.kv_heads, rep, t, self.hd).reshape(b, c.heads, t, self.hd)
        o = _causal_attention(q, k, v, c.attn)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, c.heads * self.hd))


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.dim), LlamaAttention(c)
        self.mlp_norm = RMSNorm(c.dim)
        self.gate = nn.Linear(c.dim, c.ffn, bias=False)
        self.up = nn.Linear(c.dim, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, input_ids, labels=None):
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device)[None].expand(b, t)
        cos, sin = _rope(positions, self.c.dim // self.c.heads, self.c.rope_theta, self.embed.weight.dtype)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x)).float()
        if labels is None:
            return logits
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]  # the causal-LM shift, as HF does it
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


@dataclass(kw_only=True)
class GPTConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    max_len: int = 512


class GPTBlock(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.fc, self.out = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(o)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(c.vocab, c.dim)
        self.wpe = nn.Embedding(c.max_len, c.dim)
        self.blocks = nn.ModuleList(GPTBlock(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)

    def forward(self, input_ids, targets):
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied embeddings
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
