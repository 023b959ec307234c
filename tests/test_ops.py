"""Ops that real model code uses, each with a rule: exact against one device, and split.

Complex RoPE (``torch.polar``, ``view_as_complex``, a complex product, ``view_as_real``: Meta's
reference Llama, torchtitan's Llama, DeepSeek-V2) had no rule for ``view_as_complex`` /
``view_as_real``: the plan all-gathered q and k before the rotation and ran attention on them
whole. It now runs as Ulysses: 4 all-to-alls each way, no all-gather."""

import cases
import pytest


@pytest.mark.parametrize("world,L", [(2, 64), (4, 45)])
def test_complex_rope_attention_is_ulysses_and_exact(pools, world, L):
    for r in pools(world).run(cases.complex_rope_exactness, 2, L):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref), r["loss"]
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        assert r["kinds"] == ["all_reduce", "all_to_all", "halo"][: 3 if L % world else 2], r["kinds"]
        assert r["all_to_alls"] == 8, r
