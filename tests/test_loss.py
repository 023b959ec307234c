"""Loss edge cases the sharded step must get right (each a known way hand-written and pass-based
sequence parallelism goes wrong): the causal shift across shard boundaries, pre-shifted labels,
ignore_index, token-weighted means when ranks hold very different numbers of valid tokens (here:
all of them on the last rank, or none), masked sums over counts, sums, per-sequence means, z-loss."""

import cases
import pytest
from _checks import tier

# world 2 for every case; world 4 for those whose normalization spans ranks in different ways
CASES = [(c, 2) for c in cases.LOSS_FNS] + [
    (c, 4) for c in ("shift_inside", "masked_sum_over_count", "per_sequence_mean")
]


@pytest.mark.parametrize("case,world", tier(CASES, [c for c in CASES if c[1] == 2]))
def test_loss_edge_case_matches_single_device(pools, case, world):
    for r in pools(world).run(cases.loss_exactness, case, 2, 64):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        assert r["planned"]
