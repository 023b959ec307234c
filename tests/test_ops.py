"""Ops that real model code uses, each with a rule: exact against one device, and split.

Complex RoPE (``torch.polar``, ``view_as_complex``, a complex product, ``view_as_real``: Meta's
reference Llama, torchtitan's Llama, DeepSeek-V2) had no rule for ``view_as_complex`` /
``view_as_real``: the plan all-gathered q and k before the rotation and ran attention on them
whole. It now runs as Ulysses: 4 all-to-alls each way, no all-gather. Activation functions whose
gradients torch does not tag pointwise (``softplus_backward``: Falcon-H1's Mamba layers), log-sigmoid
and a triangular solve per token (``linalg_solve_triangular``, as chunked delta rules solve per
chunk) were refused; each is now elementwise over the sequence. A router's ``topk``, ``sort`` and
``argsort`` along the features of tokens flattened from a batch of sequences were gathered
(DTensor's strategies have no strided shard); they now keep it. Writes into a buffer one index
or slice at a time (``out[:, :, i] = ...``: ``select_scatter``, no rule, and ``slice_scatter``
through the whole sequence, which DTensor's strategy gathered) are sharded alike."""

import cases
import pytest
from _checks import assert_exact, assert_matmuls_split


@pytest.mark.parametrize("world,L", [(2, 64), (4, 45)])
def test_complex_rope_attention_is_ulysses_and_exact(pools, world, L):
    results = pools(world).run(cases.complex_rope_exactness, 2, L)
    assert_matmuls_split(results, L)
    for r in results:
        assert_exact(r)
        assert r["kinds"] == ["all_reduce", "all_to_all", "halo"][: 3 if L % world else 2], r["kinds"]
        assert r["all_to_alls"] == 8, r


@pytest.mark.parametrize("kind", list(cases.OPS))
def test_ops_without_a_dtensor_strategy_stay_split(pools, kind):
    results = pools(2).run(cases.op_exactness, kind, 2, 45)
    assert_matmuls_split(results, 45)
    for r in results:
        assert_exact(r)
        assert r["kinds"] == ["all_reduce"], r["kinds"]  # the loss and the gradients: nothing gathered
