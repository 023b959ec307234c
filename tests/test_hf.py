"""Hugging Face causal LMs, unmodified (tiny random-init configs): exact against one device, with
hand-written Ulysses' collectives only. Status of each architecture: all listed ones pass."""
import pytest

import cases
import hf_models

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi", "gpt2", "gpt_neox", "opt"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_model_loss_and_grads_match_single_device(pools, arch, attn):
    for r in pools(2).run(cases.hf_exactness, arch, attn, 1, 64):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        assert r["kinds"] == ["all_reduce", "all_to_all"], r["kinds"]


@pytest.mark.parametrize("arch,attn", hf_models.MORE)
def test_more_hf_architectures_with_an_uneven_sequence(pools, arch, attn):
    """Nineteen more architectures (partial rotary, parallel blocks, ALiBi, multi-query, logit
    soft-capping, interleaved rotary, mixture-of-experts, ...), 61 tokens over 2 ranks: exact."""
    for r in pools(2).run(cases.hf_exactness, arch, attn, 1, 61, True):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert max(r["grad_err"].values()) <= 1e-5


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "gemma"])
def test_hf_model_with_uneven_sequence_on_4_ranks(pools, arch):
    """61 tokens over 4 ranks (16, 15, 15, 15): exact, with Ulysses' collectives."""
    for r in pools(4).run(cases.hf_exactness, arch, "sdpa", 1, 61):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert max(r["grad_err"].values()) <= 1e-5
        assert r["kinds"] == ["all_reduce", "all_to_all"], r["kinds"]


MASKED = [("llama", "sdpa", "right"), ("qwen3", "eager", "left"), ("opt", "sdpa", "left"),
          ("gpt2", "sdpa", "packed"), ("llama", "eager", "packed")]


@pytest.mark.parametrize("kind,attention,kinds", [("packed", "ring", ["all_reduce", "ring"]),
                                                  ("right", "kv_gather", ["all_gather", "all_reduce", "reduce_scatter"])])
def test_hf_masks_with_ring_or_gathered_kv_attention_stay_exact(pools, kind, attention, kinds):
    """HF Llama (sdpa) with packed documents and with right padding, attention forced to a ring
    and to gathered K/V: each block reads its rows and columns of the replicated mask; exact on 4
    ranks, with the kernel's collectives only (K/V gathers for the second)."""
    for r in pools(4).run(cases.hf_masked_exactness, "llama", "sdpa", kind, 2, 64, attention):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert max(r["grad_err"].values()) <= 1e-5
        assert r["kinds"] == kinds, r["kinds"]


@pytest.mark.parametrize("arch,attn,kind", MASKED)
def test_hf_padding_masks_and_packed_documents_on_4_ranks(pools, arch, attn, kind):
    """A padding attention_mask (left or right, per-row amounts that cross shard boundaries) and
    packed documents (position_ids restarting per document: HF's document-causal mask): exact, with
    Ulysses' collectives (the masks are built replicated from the full inputs, as on one device)."""
    for r in pools(4).run(cases.hf_masked_exactness, arch, attn, kind, 2, 64):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert max(r["grad_err"].values()) <= 1e-5
        assert r["kinds"] == ["all_reduce", "all_to_all"], r["kinds"]
