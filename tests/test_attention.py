"""Ring and hybrid attention's per-rank kernels against attention on the whole sequence, on real
gloo groups: exact forward and backward, and the bytes gloo ran equal to what the plan charges."""

import cases
import pytest
import torch

CASES = [(64, True), (61, False), (13, True), (3, True)]


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


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_with_a_document_mask_fp64(pools, world):
    """A document-causal mask tensor (documents crossing the chunks, one query row with no key
    at all): every block reads its rows and columns of the whole mask, a row without keys in a
    block has no weight in the merge, and a row without any key ends as the kernel's (0, 0)."""
    rs = pools(world).run(cases.ring_kernel, 61, False, torch.float64, (3, 3), True)
    assert max(r["err"] for r in rs) <= 1e-12


def test_ring_attention_grouped_heads_fp32(pools):
    """6 query heads against 2 K/V heads inside the kernel (the chunks travel at 2 heads), fp32."""
    rs = pools(4).run(cases.ring_kernel, 40, True, torch.float32, (6, 2))
    assert max(r["err"] for r in rs) <= 1e-6


def _pairs(S, n, rank, causal):
    from autosp.propagate._attention import blocks, bounds, ranges

    total = 0
    for qa, qb in ranges(S, n, rank, causal):
        for ka, kb in bounds(S, n):
            for a, b, c in blocks(qa, qb, ka, kb, causal):
                total += (qb - qa) * (qb - qa + 1) // 2 if c else (qb - qa) * (b - a)
    return total


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_zigzag_balances_causal_work(n):
    """Under a causal mask every rank computes the same (query, key) pairs to within 0.1%
    (contiguous chunks would give the last rank 2n - 1 times the first's), and the ranks together
    compute exactly the causal triangle: nothing skipped, nothing twice."""
    S = 8192
    work = [_pairs(S, n, r, True) for r in range(n)]
    assert sum(work) == S * (S + 1) // 2
    assert max(work) / min(work) <= 1.001, work
    assert sum(_pairs(S, n, r, False) for r in range(n)) == S * S


@pytest.mark.parametrize("S,causal", [(64, True), (64, False)])
def test_hybrid_attention_matches_whole_sequence_attention_fp64(pools, S, causal):
    """4 ranks as 2 sub-groups of 2: all-to-alls within a sub-group (4 query / 2 K/V heads become
    2 / 1 per rank over the sub-group's sequence), ring attention across the sub-groups; output,
    log-sum-exp and gradients equal the whole-sequence kernel's (fp64, 1e-12), and gloo sent
    exactly ``hybrid_bytes``' bytes."""
    rs = pools(4).run(cases.hybrid_kernel, S, causal)
    assert max(r["err"] for r in rs) <= 1e-12
    assert sum(r["sent"] for r in rs) == pytest.approx(4 * rs[0]["planned"], rel=1e-12)
