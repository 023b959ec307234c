"""A Llama whose attention is FlexAttention (``torch.nn.attention.flex_attention``, as torchtitan
runs it), with block masks built outside the step as torchtitan's trainer builds them: causal,
a causal sliding window, and packed documents (document ids from positions that restart at each
document). Score functions: none, a tanh soft-cap (Gemma 2's), and ALiBi (a per-head slope read
from a captured tensor by head index, times the query-key distance).

torch 2.13 refuses FlexAttention's backward on CPU in its public function
(``_validate_device``); its dense implementation trains exactly, so the tests lift the check."""

from __future__ import annotations

import torch
import torch.nn.attention.flex_attention as fa
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from examples.models import Llama, LlamaAttention, LlamaConfig

__all__ = ["FlexLlama", "block_mask", "documents"]

fa._validate_device = lambda *args, **kwargs: None  # the CPU backward (see the module docstring)

WINDOW = 16
BLOCK = 16  # small sparse blocks: a test length has several, so a rank's rows start one or not


def documents(L: int, parts: int = 3, rows: int = 1) -> torch.Tensor:
    """Positions of ``parts`` packed documents of uneven lengths in each of ``rows`` rows of L
    tokens (restarting at 0 at each document, as torchtitan's data loader makes them; each row cut
    elsewhere)."""
    out = torch.empty(rows, L, dtype=torch.long)
    for r in range(rows):
        cuts = sorted({max(1, L * i // parts + (i % 2) * 3 - 5 * r) for i in range(1, parts)})
        for a, b in zip([0, *cuts], [*cuts, L]):
            out[r, a:b] = torch.arange(b - a)
    return out


def block_mask(
    kind: str, L: int, positions: torch.Tensor | None = None, heads: int = 4, block: int = BLOCK, device: str = "cpu"
):
    """The block mask ``kind`` for sequences of L: "causal", "window", "documents" (one row of
    packed documents per sequence of ``positions``, its block mask per sequence where there are
    several), "heads" (a causal window of 8 (h + 1) tokens for head h: a block mask per head) or
    "none" (no block mask: flex_attention builds its own, every block full). ``block``: the sparse
    block size (torch's default, 128, on a GPU)."""
    if kind == "none":
        return None
    H = heads if kind == "heads" else None
    B = positions.shape[0] if kind == "documents" and positions.shape[0] > 1 else None
    if kind == "documents":
        doc = (torch.cumsum((positions == 0).int(), 1) - 1).to(device)

        def mask(b, h, q, kv):
            return (q >= kv) & (doc[b, q] == doc[b, kv])
    elif kind == "heads":

        def mask(b, h, q, kv):
            return (q >= kv) & (q - kv < 8 * (h + 1))
    elif kind == "window":

        def mask(b, h, q, kv):
            return (q >= kv) & (q - kv < WINDOW)
    else:

        def mask(b, h, q, kv):
            return q >= kv

    return create_block_mask(mask, B, H, L, L, device=device, BLOCK_SIZE=block)


class FlexAttention(LlamaAttention):
    """``LlamaAttention`` running FlexAttention (K/V heads grouped inside it) with the block mask
    and score function its model sets (``mask``, ``score_mod``)."""

    mask = None
    score_mod = None
    lse = False  # also read the log-sum-exp (return_lse), weighting each row's output by it

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        c, hd = self.c, self.hd
        q = self.q_proj(x).view(b, t, c.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.kv_heads, hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.lse:  # the log-sum-exp's gradient reaches the op (its backward's grad_logsumexp)
            o, lse = flex_attention(
                q, k, v, score_mod=self.score_mod, block_mask=self.mask, enable_gqa=True, return_lse=True
            )
            o = o * torch.sigmoid(lse)[..., None]
        else:
            o = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=self.mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, c.heads * hd))


class FlexLlama(Llama):
    """``examples.models.Llama`` with FlexAttention and ``score`` ("none", "softcap" or "alibi"),
    its log-sum-exp read too with ``lse``; ``forward(input_ids, labels, block_mask)``."""

    def __init__(self, c: LlamaConfig, score: str = "none", lse: bool = False):
        super().__init__(c)
        self.score = score
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, c.heads + 1) / c.heads), persistent=False)
        for block in self.blocks:
            block.attn.__class__ = FlexAttention
            block.attn.lse = lse

    def _score_mod(self):
        if self.score == "softcap":
            return lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0)
        if self.score == "alibi":
            slopes = self.slopes
            return lambda s, b, h, q, kv: s - slopes[h] * (q - kv)
        return None

    def forward(self, input_ids, labels, block_mask):
        score_mod = self._score_mod()
        for block in self.blocks:
            block.attn.mask, block.attn.score_mod = block_mask, score_mod
        return super().forward(input_ids, labels)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
