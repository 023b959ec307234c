"""Ring attention's per-rank kernels against attention on the whole sequence, on real gloo groups:
exact forward and backward, and the bytes gloo ran equal to what the plan charges."""
import pytest
import torch

import cases

CASES = [(64, True), (61, False), (61, True), (13, True), (3, True)]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_whole_sequence_attention_fp64(pools, world):
    """Catches a wrong causal block (a key seen before its query, or missed), a zigzag half-chunk
    put back in the wrong place, a gradient accumulator that skips a rank or comes home to the
    wrong one, uneven or empty chunks (61, 13 and 3 tokens), and a byte count in the plan that is
    not what runs: the output, log-sum-exp and the three gradients of every rank's rows equal the
    kernel's on the whole sequence (fp64, 1e-12 of the largest), and gloo's all-to-all events
    carry exactly ``ring_bytes``' bytes."""
    pool = pools(world)
    for S, causal in CASES:
        rs = pool.run(cases.ring_kernel, S, causal)
        assert max(r["err"] for r in rs) <= 1e-12, (S, causal)
        assert {name for r in rs for name, _ in r["events"]} == {"gloo:all_to_all"}
        assert sum(r["sent"] for r in rs) == pytest.approx(world * rs[0]["planned"], rel=1e-12), (S, causal)


def test_ring_attention_grouped_heads_fp32(pools):
    """6 query heads against 2 K/V heads inside the kernel (the chunks travel at 2 heads), fp32."""
    rs = pools(4).run(cases.ring_kernel, 40, True, torch.float32, (6, 2))
    assert max(r["err"] for r in rs) <= 1e-6
