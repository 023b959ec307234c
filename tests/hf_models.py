"""Tiny random-init Hugging Face causal LMs, built from configs (no downloads)."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_COMMON = dict(vocab_size=128, num_hidden_layers=2)
# a config.json for ``autosp plan`` (tests/test_checkpoint.py, tests/test_plan_cli.py): a Llama of
# 3 layers, 4 query and 2 K/V heads
TINY_HF = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
_DROPOUT = (
    "attention_dropout",
    "hidden_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "dropout",
    "activation_dropout",
    "embd_pdrop",
    "summary_first_dropout",
)


def configs():
    import transformers as T

    return {
        "llama": T.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **_COMMON
        ),
        "qwen2": T.Qwen2Config(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **_COMMON
        ),
        "qwen3": T.Qwen3Config(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **_COMMON
        ),
        "mistral": T.MistralConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **_COMMON
        ),
        "gemma": T.GemmaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **_COMMON
        ),
        "phi": T.PhiConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, **_COMMON),
        "gpt2": T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=128),
        "gpt_neox": T.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, **_COMMON),
        "opt": T.OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
            **_COMMON,
        ),
    }


def build(arch: str, attn: str):
    import torch
    import transformers as T

    cfg = configs()[arch]
    for k in _DROPOUT:
        if hasattr(cfg, k):
            setattr(cfg, k, 0.0)
    cfg.use_cache = False
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    model.loss_type = "ForCausalLM"  # some configs carry none, and HF's warning about it breaks the graph
    return model


# More architectures, from their default configs shrunk to tiny sizes (attributes a config lacks
# are skipped): (model type, attention implementation; "eager" where HF has no SDPA path).
MORE = [
    ("stablelm", "sdpa"),
    ("starcoder2", "sdpa"),
    ("olmo2", "sdpa"),
    ("granite", "sdpa"),
    ("gemma3_text", "sdpa"),
    ("cohere", "sdpa"),
    ("phi3", "sdpa"),
    ("glm", "sdpa"),
    ("gptj", "sdpa"),
    ("codegen", "eager"),
    ("gemma2", "eager"),
    ("bloom", "eager"),
    ("falcon", "eager"),
    ("gpt_bigcode", "sdpa"),
    ("persimmon", "sdpa"),
    ("nemotron", "sdpa"),
]
_TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=128,
    head_dim=16,
    max_position_embeddings=256,
    n_positions=256,
    n_ctx=256,
    rotary_dim=8,
    pad_token_id=0,
    use_cache=False,
    tie_word_embeddings=False,
)


# Per-architecture sizes on top of ``_TINY``, where a default config shrunk so misses what the
# model is: Qwen3-Next's layers alternate linear (gated delta rule) and full attention, and its
# default of 512 experts is mostly router.
_OVERRIDES = {
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
}


def build_generic(model_type: str, attn: str, experts: str | None = None):
    """``experts``: a mixture-of-experts model's experts implementation (HF's default if None)."""
    import torch
    import transformers as T

    cfg = T.CONFIG_MAPPING[model_type]()
    for k, v in {**_TINY, **_OVERRIDES.get(model_type, {})}.items():
        with contextlib.suppress(AttributeError, ValueError, TypeError):
            setattr(cfg, k, v)
    for k in dir(cfg):
        if "dropout" in k or k.endswith("pdrop"):
            with contextlib.suppress(AttributeError, ValueError, TypeError):
                setattr(cfg, k, 0.0)
    torch.manual_seed(0)
    kw = {} if experts is None else dict(experts_implementation=experts)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, **kw)
    model.loss_type = "ForCausalLM"
    return model
