"""Tiny random-init models built from peer libraries' OWN model classes, for tests.

Every ``build_*`` function returns ``(model, loss_fn)`` where ``loss_fn(model, ids)``
computes that library's usual next-token loss for an int64 ``ids`` of shape (B, T).
Models are fp32, on CPU, random init, with no weights downloaded.

Pinned versions (see report.md): torchtitan 0.3.0, torchtune 0.6.1, litgpt 0.5.13,
x-transformers 2.31.10, torch 2.13.0 (CPU).

Tiny config convention: 2 layers, dim 64, 4 heads (2 KV heads where GQA exists),
vocab 256.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types

import torch
import torch.nn.functional as F

VOCAB = 256
DIM = 64
N_LAYERS = 2
N_HEADS = 4
N_KV_HEADS = 2
MAX_SEQ_LEN = 512


def shift_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Plain next-token CE: position t predicts ids[:, t+1]."""
    v = logits.size(-1)
    return F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), ids[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------
# torchtitan 0.3.0
# ---------------------------------------------------------------------------
# torchtitan.models.common -> moe -> token_dispatcher -> distributed.minimal_async_ep
# does a hard module-level ``import triton`` (Triton kernels for expert-parallel
# all-to-all on CUDA).  The triton wheel is ~285 MB and useless on CPU, so we let
# the import succeed with a throw-away stub that is removed from sys.modules right
# after, so torch never sees a "triton" package.  If real triton is installed the
# stub is not used.


class _Anything:
    """Absorbs any attribute access / call / indexing (only used at import)."""

    def __init__(self, name="triton_stub"):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        # @triton.jit used bare: return the function unchanged-ish
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return _Anything(getattr(args[0], "__name__", "fn"))
        return _Anything(self._name)

    def __getitem__(self, item):
        return _Anything(self._name)

    def __repr__(self):
        return f"<{self._name} (triton stub)>"


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self.__name__}.{item}")


@contextlib.contextmanager
def _triton_stub():
    if importlib.util.find_spec("triton") is not None:
        yield
        return
    # Prime torch's cached "is triton installed?" probes, and import the torch
    # modules that probe triton at import time (torchtitan's FlexAttention calls
    # torch.compile(...) at class-definition time, which imports inductor), while
    # triton is still absent, so they record "no triton".
    import torch._dynamo
    import torch._dynamo.repro.after_dynamo
    import torch._inductor.compile_fx
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch.utils._triton as _tt

    _tt.has_triton_package()
    _tt.has_triton()
    names = ["triton", "triton.language"]
    for n in names:
        m = _StubModule(n)
        m.__spec__ = importlib.machinery.ModuleSpec(n, None)
        m.__path__ = []  # pretend package
        sys.modules[n] = m
    sys.modules["triton"].language = sys.modules["triton.language"]
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)


def _import_torchtitan():
    with _triton_stub():
        import torchtitan.components.loss
        import torchtitan.models.common
        import torchtitan.models.deepseek_v3
        import torchtitan.models.llama3
        import torchtitan.models.qwen3  # noqa: F401
    return sys.modules["torchtitan"]


def _titan_set_inner_attention(layers, attn: str):
    """attn: 'sdpa' (F.scaled_dot_product_attention, is_causal=True, no mask) or
    'flex' (torchtitan's default: FlexAttention + block-causal BlockMask)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if attn == "flex":
        return layers
    assert attn == "sdpa", attn
    out = []
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        out.append(layer)
    return out


def _titan_finish(config, attn: str, seed: int):
    """Build on CPU, init params/buffers, make loss_fn."""
    from torchtitan.components.loss import cross_entropy_loss

    torch.manual_seed(seed)
    model = config.build()
    # torchtitan normally builds on meta, then to_empty(device) + init_states().
    # Building directly on CPU also works; init_states() (re)initialises params
    # with the per-param ``param_init`` fns and recomputes buffers (RoPE cache,
    # MoE expert_bias / tokens_per_expert) on buffer_device.
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    model.train()

    def loss_fn(model, ids):
        # torchtitan's trainer feeds inputs = tokens[:-1], labels = tokens[1:]
        # (the shift is done by the dataloader) and uses cross_entropy_loss
        # (reduction="sum", fp32 upcast, ignore_index=-100) divided by the number of
        # valid tokens.  Here the model sees all T tokens (keeps T divisible for
        # sequence parallelism) and the shift is applied to the logits instead,
        # which is numerically the same causal-LM loss.
        labels = ids[:, 1:]
        if attn == "flex":
            B, L = ids.shape
            positions = torch.arange(L, device=ids.device).unsqueeze(0).expand(B, L)
            masks = model.get_attention_masks(positions)
            pred = model(ids, positions=positions, attention_masks=masks)
        else:
            pred = model(ids)
        return cross_entropy_loss(pred[:, :-1], labels) / labels.numel()

    return model, loss_fn


def build_torchtitan_llama3(attn: str = "sdpa", seed: int = 0):
    """torchtitan Llama3Model (fused wqkv GQA, ComplexRoPE complex64 cache)."""
    _import_torchtitan()
    from torchtitan.models import llama3 as L3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    layers = L3._build_llama3_layers(
        fuse_qkv=True,
        n_layers=N_LAYERS,
        dim=DIM,
        n_heads=N_HEADS,
        n_kv_heads=N_KV_HEADS,
        hidden_dim=4 * DIM,
        rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=MAX_SEQ_LEN, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    layers = _titan_set_inner_attention(layers, attn)
    config = L3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=L3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=L3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=L3._output_linear_init(DIM)),
        layers=layers,
    )
    return _titan_finish(config, attn, seed)


def build_torchtitan_llama3_flex(seed: int = 0):
    """torchtitan's Llama3 with its default attention, FlexAttention with the causal packed-document
    BlockMask it builds from positions (inside the loss here). Its FlexAttention calls a
    ``torch.compile``d flex_attention: inside autosp's compile Dynamo inlines it; the single-device
    reference runs it uncompiled, as torch 2.13 cannot compile its backward for a CPU (``flex_models``
    lifts the public function's CPU check the same way), and builds its mask uncompiled too."""
    import flex_models  # noqa: F401  FlexAttention's backward on CPU
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _import_torchtitan()
    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = flex_attention
    attention._compiled_create_block_mask = create_block_mask  # nor its mask (no compiles but autosp's)
    return build_torchtitan_llama3("flex", seed)


def build_torchtitan_qwen3(attn: str = "sdpa", seed: int = 0):
    """torchtitan Qwen3Model (qk-norm, CosSinRoPE, tied embeddings)."""
    _import_torchtitan()
    from torchtitan.models import qwen3 as Q3
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.rope import CosSinRoPE

    head_dim = DIM // N_HEADS
    layers = Q3._build_qwen3_layers(
        fuse_qkv=True,
        n_layers=N_LAYERS,
        dim=DIM,
        n_heads=N_HEADS,
        n_kv_heads=N_KV_HEADS,
        head_dim=head_dim,
        hidden_dim=3 * DIM,
        attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=MAX_SEQ_LEN, theta=1e6),
    )
    layers = _titan_set_inner_attention(layers, attn)
    config = Q3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=Q3._qwen3_norm(DIM),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=Q3._EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=Q3._LINEAR_INIT),
        layers=layers,
    )
    return _titan_finish(config, attn, seed)


def build_torchtitan_qwen3_moe(attn: str = "sdpa", seed: int = 0):
    """torchtitan Qwen3 MoE (4 experts, top-2, local token dispatcher)."""
    _import_torchtitan()
    from torchtitan.models import qwen3 as Q3
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.rope import CosSinRoPE

    head_dim = DIM // N_HEADS
    layers = Q3._build_qwen3_moe_layers(
        fuse_qkv=True,
        n_layers=N_LAYERS,
        dim=DIM,
        n_heads=N_HEADS,
        n_kv_heads=N_KV_HEADS,
        head_dim=head_dim,
        moe_hidden_dim=2 * DIM,
        num_experts=4,
        top_k=2,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=MAX_SEQ_LEN, theta=1e6),
    )
    layers = _titan_set_inner_attention(layers, attn)
    config = Q3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=Q3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=Q3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=Q3._LINEAR_INIT),
        layers=layers,
    )
    return _titan_finish(config, attn, seed)


def _token_local_moe(built):
    """Every torchtitan ``MoE`` layer of ``built`` marked ``autosp.token_local`` (its router,
    local dispatch, experts and ``deterministic_scatter_add``, a counter buffer updated in place)."""
    import autosp

    model, fn = built
    marked = [autosp.token_local(m) for m in model.modules() if type(m).__name__ == "MoE"]
    assert marked, "no MoE layer"
    return model, fn


def build_torchtitan_deepseek_v3(attn: str = "sdpa", seed: int = 0):
    """torchtitan DeepSeekV3Model: MLA attention, layer 0 dense, layer 1 MoE
    (4 routed experts top-2 + 1 shared expert), yarn ComplexRoPE."""
    _import_torchtitan()
    from torchtitan.models import deepseek_v3 as DS
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    rope_dim = 8
    layers = DS._build_dsv3_layers(
        n_layers=N_LAYERS,
        n_dense_layers=1,
        dim=DIM,
        n_heads=N_HEADS,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope_dim,
        v_head_dim=16,
        mscale=0.70,
        dense_hidden_dim=4 * DIM,
        moe_hidden_dim=DIM,
        num_experts=4,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=rope_dim,
            max_seq_len=MAX_SEQ_LEN * 4,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=MAX_SEQ_LEN,
        ),
    )
    layers = _titan_set_inner_attention(layers, attn)
    config = DS.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=DS._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=DS._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=DS._output_linear_init(DIM)),
        layers=layers,
        mtp_layers=[],
    )
    return _titan_finish(config, attn, seed)


# ---------------------------------------------------------------------------
# torchtune 0.6.1  (needs torchao importable: `import torchtune` hard-requires it)
# ---------------------------------------------------------------------------


def _tune_loss(loss: str, num_output_chunks: int = 8):
    """torchtune recipe-style loss (recipes/full_finetune_single_device.py):

        labels = hstack(labels[..., 1:], ignore_index column)   # shift, keep length T
        logits = model(tokens)          # list of chunks if set_num_output_chunks()
        loss = loss_fn(logits, labels)  # CEWithChunkedOutputLoss or CrossEntropyLoss

    loss="ce": torch.nn.CrossEntropyLoss(ignore_index=-100) on full logits.
    loss="chunked": CEWithChunkedOutputLoss (the default in torchtune's shipped
    configs); the model's ``chunked_output`` is ``@torch.compiler.disable``.
    """
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    ignore_index = -100
    if loss == "chunked":
        ce = CEWithChunkedOutputLoss(num_output_chunks=num_output_chunks)
    elif loss == "ce":
        ce = torch.nn.CrossEntropyLoss(ignore_index=ignore_index)
    else:
        raise ValueError(loss)

    def loss_fn(model, ids):
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], ignore_index)], dim=1)
        logits = model(ids)
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        return ce(logits, labels)

    return ce, loss_fn


def _tune_finish(model, loss: str, seed: int):
    ce, loss_fn = _tune_loss(loss)
    if loss == "chunked":
        model.set_num_output_chunks(ce.num_output_chunks)
    model.train()
    return model, loss_fn


def build_torchtune_llama3_2(loss: str = "ce", seed: int = 0):
    """torchtune.models.llama3_2._component_builders.llama3_2 (GQA, tied emb)."""
    from torchtune.models.llama3_2._component_builders import llama3_2

    torch.manual_seed(seed)
    model = llama3_2(
        vocab_size=VOCAB,
        num_layers=N_LAYERS,
        num_heads=N_HEADS,
        num_kv_heads=N_KV_HEADS,
        embed_dim=DIM,
        max_seq_len=MAX_SEQ_LEN,
        intermediate_dim=4 * DIM,
        tie_word_embeddings=True,
    )
    return _tune_finish(model, loss, seed)


def build_torchtune_qwen2(loss: str = "ce", seed: int = 0):
    """torchtune.models.qwen2._component_builders.qwen2 (q/k/v bias, GQA)."""
    from torchtune.models.qwen2._component_builders import qwen2

    torch.manual_seed(seed)
    model = qwen2(
        vocab_size=VOCAB,
        num_layers=N_LAYERS,
        num_heads=N_HEADS,
        num_kv_heads=N_KV_HEADS,
        embed_dim=DIM,
        intermediate_dim=4 * DIM,
        max_seq_len=MAX_SEQ_LEN,
        tie_word_embeddings=False,
    )
    return _tune_finish(model, loss, seed)


def build_torchtune_gemma2(loss: str = "ce", seed: int = 0, sliding_window: int = 16):
    """torchtune.models.gemma2._component_builders.gemma2: Gemma2Attention (manual
    attention with tanh soft-capping, sliding window on even layers), final logit
    soft-capping, tied embeddings."""
    from torchtune.models.gemma2._component_builders import gemma2

    torch.manual_seed(seed)
    model = gemma2(
        vocab_size=VOCAB,
        num_layers=N_LAYERS,
        num_heads=N_HEADS,
        head_dim=DIM // N_HEADS,
        num_kv_heads=N_KV_HEADS,
        embed_dim=DIM,
        intermediate_dim=4 * DIM,
        max_seq_len=MAX_SEQ_LEN,
        sliding_window_size=sliding_window,
        query_pre_attn_scalar=DIM // N_HEADS,
    )
    return _tune_finish(model, loss, seed)


# ---------------------------------------------------------------------------
# litgpt 0.5.13
# ---------------------------------------------------------------------------

_LITGPT_VARIANTS = {
    # name -> (Config.from_name name, extra overrides)
    "llama3_2": ("Llama-3.2-1B", dict(n_query_groups=N_KV_HEADS)),
    "mistral": (  # sliding window on every layer (window < seq so it matters)
        "Mistral-7B-v0.1",
        dict(n_query_groups=N_KV_HEADS, sliding_window_size=16, sliding_window_indices=[1] * N_LAYERS),
    ),
    "phi2": (  # parallel residual, partial rotary (0.4 * 16 = 6 dims), biases, GELU MLP
        "phi-2",
        dict(n_query_groups=N_HEADS, intermediate_size=4 * DIM),
    ),
    "gemma2": (  # attention logit soft-capping (manual attention) + final logit
        # soft-capping, sliding window on even layers, post-attn/mlp norms
        "Gemma-2-2b",
        dict(
            n_query_groups=N_KV_HEADS,
            attention_scores_scalar=DIM // N_HEADS,
            sliding_window_size=16,
            sliding_window_indices=[1, 0],
        ),
    ),
    "gemma3": (  # qk-norm, local/global rope bases, sliding window (no soft-capping)
        "Gemma-3-1b-it",
        dict(
            n_query_groups=N_KV_HEADS,
            attention_scores_scalar=DIM // N_HEADS,
            sliding_window_size=16,
            sliding_window_indices=[1, 0],
            rope_indices=[1, 0],
        ),
    ),
    "mixtral": (  # MoE: 4 experts, top-2, python loop over experts with torch.where
        "Mixtral-8x7B-v0.1",
        dict(n_query_groups=N_KV_HEADS, n_expert=4, n_expert_per_token=2, moe_intermediate_size=2 * DIM),
    ),
}


def litgpt_config(variant: str, **overrides):
    from litgpt import Config

    name, extra = _LITGPT_VARIANTS[variant]
    kw = dict(
        n_layer=N_LAYERS,
        n_embd=DIM,
        n_head=N_HEADS,
        head_size=DIM // N_HEADS,
        intermediate_size=4 * DIM,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        block_size=MAX_SEQ_LEN,
    )
    kw.update(extra)
    kw.update(overrides)
    return Config.from_name(name, **kw)


def build_litgpt(variant: str = "llama3_2", seed: int = 0, chunk_size: int = 128, **overrides):
    """litgpt.GPT(litgpt.Config.from_name(<real name>, n_layer=2, n_embd=64, ...)).

    Loss as in litgpt/finetune/full.py: ``chunked_cross_entropy(logits[..., :-1, :],
    targets[..., 1:])`` (litgpt/pretrain.py does the same with a pre-shifted
    target).  Weights: ``model.apply(model._init_weights)`` (N(0, 0.02)).
    """
    import litgpt
    from litgpt.utils import chunked_cross_entropy

    torch.manual_seed(seed)
    config = litgpt_config(variant, **overrides)
    model = litgpt.GPT(config)
    model.apply(model._init_weights)
    model.train()

    def loss_fn(model, ids):
        logits = model(ids)
        return chunked_cross_entropy(logits[..., :-1, :], ids[..., 1:], chunk_size=chunk_size)

    return model, loss_fn


def build_litgpt_head_chunks(variant: str = "llama3_2", seed: int = 0, lm_head_chunk_size: int = 16):
    """litgpt's model with its head in chunks of the sequence, and the loss litgpt/finetune/lora.py
    writes for it: ``model(ids, lm_head_chunk_size=128)`` returns a list of logits chunks, the
    last cut by one row, then ``chunked_cross_entropy(logits, targets[..., 1:])``."""
    import litgpt
    from litgpt.utils import chunked_cross_entropy

    torch.manual_seed(seed)
    model = litgpt.GPT(litgpt_config(variant))
    model.apply(model._init_weights)
    model.train()

    def loss_fn(model, ids):
        logits = model(ids, lm_head_chunk_size=lm_head_chunk_size)
        logits[-1] = logits[-1][..., :-1, :]
        return chunked_cross_entropy(logits, ids[..., 1:])

    return model, loss_fn


def build_litgpt_llama3_2(**kw):
    return build_litgpt("llama3_2", **kw)


def build_litgpt_mistral(**kw):
    return build_litgpt("mistral", **kw)


def build_litgpt_phi2(**kw):
    return build_litgpt("phi2", **kw)


def build_litgpt_gemma2(**kw):
    return build_litgpt("gemma2", **kw)


def build_litgpt_gemma3(**kw):
    return build_litgpt("gemma3", **kw)


def build_litgpt_mixtral(**kw):
    return build_litgpt("mixtral", **kw)


# ---------------------------------------------------------------------------
# x-transformers 2.31.10
# ---------------------------------------------------------------------------

_XT_VARIANTS = {
    "base": dict(rotary_pos_emb=True, ff_glu=True),  # manual einsum attention
    "flash": dict(rotary_pos_emb=True, ff_glu=True, attn_flash=True),  # F.sdpa
    "alibi": dict(alibi_pos_bias=True, ff_glu=True),
    "gqa": dict(rotary_pos_emb=True, ff_glu=True, attn_kv_heads=N_KV_HEADS),
    "qk_norm": dict(rotary_pos_emb=True, ff_glu=True, attn_qk_norm=True),
    "value_residual": dict(rotary_pos_emb=True, ff_glu=True, add_value_residual=True),
    "attn_on_attn": dict(rotary_pos_emb=True, ff_glu=True, attn_on_attn=True),
    "shift_tokens": dict(rotary_pos_emb=True, ff_glu=True, shift_tokens=1),
}


def build_x_transformers(variant: str = "base", seed: int = 0, **decoder_kw):
    """AutoregressiveWrapper(TransformerWrapper(num_tokens=256, attn_layers=Decoder(...))).

    The returned *model* is the AutoregressiveWrapper (its ``.net`` is the
    TransformerWrapper); ``loss_fn(model, ids)`` is just ``model(ids)``, which feeds
    all T tokens and computes CE of logits[:, :-1] vs ids[:, 1:].
    """
    from x_transformers import AutoregressiveWrapper, Decoder, TransformerWrapper

    torch.manual_seed(seed)
    kw = dict(dim=DIM, depth=N_LAYERS, heads=N_HEADS, attn_dim_head=DIM // N_HEADS)
    kw.update(_XT_VARIANTS[variant])
    kw.update(decoder_kw)
    net = TransformerWrapper(num_tokens=VOCAB, max_seq_len=MAX_SEQ_LEN, attn_layers=Decoder(**kw))
    model = AutoregressiveWrapper(net)
    model.train()

    def loss_fn(model, ids):
        return model(ids)

    return model, loss_fn


def build_x_transformers_base(**kw):
    return build_x_transformers("base", **kw)


def build_x_transformers_flash(**kw):
    return build_x_transformers("flash", **kw)


def build_x_transformers_alibi(**kw):
    return build_x_transformers("alibi", **kw)


def build_x_transformers_gqa(**kw):
    return build_x_transformers("gqa", **kw)


def build_x_transformers_qk_norm(**kw):
    return build_x_transformers("qk_norm", **kw)


def build_x_transformers_value_residual(**kw):
    return build_x_transformers("value_residual", **kw)


def build_x_transformers_attn_on_attn(**kw):
    return build_x_transformers("attn_on_attn", **kw)


def build_x_transformers_shift_tokens(**kw):
    return build_x_transformers("shift_tokens", **kw)


# Registry of everything above: name -> zero-arg builder.
BUILDERS = {
    "torchtitan_llama3": build_torchtitan_llama3,
    "torchtitan_llama3_flex": build_torchtitan_llama3_flex,
    "torchtitan_qwen3": build_torchtitan_qwen3,
    "torchtitan_qwen3_moe": build_torchtitan_qwen3_moe,
    "torchtitan_deepseek_v3": build_torchtitan_deepseek_v3,
    "torchtitan_qwen3_moe_marked": lambda **kw: _token_local_moe(build_torchtitan_qwen3_moe(**kw)),
    "torchtitan_deepseek_v3_marked": lambda **kw: _token_local_moe(build_torchtitan_deepseek_v3(**kw)),
    "torchtune_llama3_2": build_torchtune_llama3_2,
    "torchtune_qwen2": build_torchtune_qwen2,
    "torchtune_gemma2": build_torchtune_gemma2,
    "litgpt_llama3_2": build_litgpt_llama3_2,
    "litgpt_mistral": build_litgpt_mistral,
    "litgpt_phi2": build_litgpt_phi2,
    "litgpt_gemma2": build_litgpt_gemma2,
    "litgpt_gemma3": build_litgpt_gemma3,
    "litgpt_mixtral": build_litgpt_mixtral,
    # litgpt's chunked loss in chunks shorter than the sequence: a split along it
    "litgpt_llama3_2_chunk16": lambda **kw: build_litgpt_llama3_2(chunk_size=16, **kw),
    # its head in 16-row chunks, the last cut by one (litgpt/finetune/lora.py's form)
    "litgpt_llama3_2_head_chunks": build_litgpt_head_chunks,
    **{f"x_transformers_{v}": globals()[f"build_x_transformers_{v}"] for v in _XT_VARIANTS},
}
