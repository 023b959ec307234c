"""Hugging Face causal LMs, unmodified (tiny random-init configs): exact against one device, with
hand-written Ulysses' collectives only, and every rank's forward matmul FLOPs its share of one
device's. Status of each architecture: all listed ones pass; the mixture-of-experts ones are
exact but their expert layers are not split (pinned below)."""

import cases
import hf_models
import pytest
from _checks import assert_matmuls_split

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi", "gpt2", "gpt_neox", "opt"]
MOE = {"mixtral", "olmoe", "qwen2_moe"}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_model_loss_and_grads_match_single_device(pools, arch, attn):
    results = pools(2).run(cases.hf_exactness, arch, attn, 1, 64)
    assert_matmuls_split(results, 64)
    for r in results:
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        assert r["kinds"] == ["all_reduce", "all_to_all"], r["kinds"]


@pytest.mark.parametrize("arch,attn", hf_models.MORE)
def test_more_hf_architectures_with_an_uneven_sequence(pools, arch, attn):
    """Nineteen more architectures (partial rotary, parallel blocks, ALiBi, multi-query, logit
    soft-capping, interleaved rotary, mixture-of-experts, ...), 61 tokens over 2 ranks: exact, and
    split, but for the experts of the mixture-of-experts models: their token dispatch by indexing
    has no rule, so each rank runs the experts on every token (1.5-1.9x one device's matmul FLOPs
    together; tiny HF models, 2 ranks), a finding this pins until the dispatch splits."""
    results = pools(2).run(cases.hf_exactness, arch, attn, 1, 61, True)
    if arch in MOE:
        assert sum(r["flops"][0] for r in results) > 1.4 * results[0]["flops"][1]
    else:
        assert_matmuls_split(results, 61)
    for r in results:
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert max(r["grad_err"].values()) <= 1e-5


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "gemma"])
def test_hf_model_with_uneven_sequence_on_4_ranks(pools, arch):
    """61 tokens over 4 ranks (16, 15, 15, 15): exact, with Ulysses' collectives."""
    results = pools(4).run(cases.hf_exactness, arch, "sdpa", 1, 61)
    assert_matmuls_split(results, 61)
    for r in results:
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert max(r["grad_err"].values()) <= 1e-5
        assert r["kinds"] == ["all_reduce", "all_to_all"], r["kinds"]


MASKED = [
    ("llama", "sdpa", "right", "kv_gather"),
    ("qwen3", "eager", "left", "auto"),
    ("opt", "sdpa", "left", "auto"),
    ("gpt2", "sdpa", "packed", "auto"),
    ("llama", "eager", "packed", "auto"),
    ("llama", "sdpa", "packed", "ring"),
]


_KINDS = {
    "auto": ["all_reduce", "all_to_all"],
    "ring": ["all_reduce", "ring"],
    "kv_gather": ["all_gather", "all_reduce", "reduce_scatter"],
}


@pytest.mark.parametrize("arch,attn,kind,attention", MASKED)
def test_hf_padding_masks_and_packed_documents_on_4_ranks(pools, arch, attn, kind, attention):
    """A padding attention_mask (left or right, per-row amounts that cross shard boundaries) and
    packed documents (position_ids restarting per document: HF's document-causal mask): exact, with
    Ulysses' collectives (the masks are built replicated from the full inputs, as on one device),
    and with attention forced to a ring or to gathered K/V, whose blocks read their rows and
    columns of the replicated mask (the kernel's collectives only)."""
    results = pools(4).run(cases.hf_masked_exactness, arch, attn, kind, 2, 64, attention)
    assert_matmuls_split(results, 64)
    for r in results:
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert max(r["grad_err"].values()) <= 1e-5
        assert r["kinds"] == _KINDS[attention], r["kinds"]
