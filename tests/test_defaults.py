"""Exactness under the defaults users run: Inductor and symbolic lengths (``dynamic=True``).

The suite mostly runs ``aot_eager`` on static lengths; on the defaults, a hand-written Llama
whose loss shifts the logits (``logits[:, :-1]`` against ``ids[:, 1:]``, as torchtitan,
torchtune and x-transformers write it) stopped in Inductor's lowering of the per-rank backward:
"LoweringException: IndexError: pop from empty list" on a reshape to ``[-1]`` of a halo piece
whose size is a clamped expression of the length that is 0 at the first length
(``Max(0, -(s//2) + Min(s - 1, s//2, 2*(s//2)))``). The halo exchange now moves rows along
dim 0 without flattening them."""

import cases
from _checks import assert_matmuls_split


def test_logits_shift_llama_on_inductor_and_symbolic_lengths_is_exact_and_split(pools):
    """Lengths 64 and 50 on one compile (even shards), 37 on a second (odd): every loss and
    gradient within 1e-5 of one device's; Ulysses' collectives and a halo exchange, nothing
    gathered; each rank's matmuls its share of one device's at 37 tokens."""
    lengths = [64, 50, 37]
    results = pools(2).run(cases.many_lengths, "llama_shift_logits", lengths, 8, True, None, None, "inductor")
    for r in results:
        for loss, ref, err in r["steps"]:
            assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, r["steps"]
        assert r["compiled"] == 1 and r["graphs"] == 2, r
        assert r["kinds"] == ["all_reduce", "all_to_all", "halo"], r["kinds"]
    assert_matmuls_split([{"flops": r["flops"]} for r in results], lengths[-1])
