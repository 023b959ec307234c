"""Data x sequence parallel meshes on 4 ranks: each dp replica takes its slice of the global batch
(dim 0), runs it sequence-parallel over its sp group, returns its own loss (as a DDP replica
does), and every parameter's gradient is the mean over the replicas (DDP's averaging)."""

import cases
import pytest
from _checks import tier


@pytest.mark.parametrize(
    "dp,kind,b,L",
    tier(
        [(dp, *m) for m in [("llama", 4, 64), ("gpt", 4, 45)] for dp in (2, 4, 1)],
        [(2, "llama", 4, 64), (4, "gpt", 4, 45)],
    ),
)
def test_dp_by_sp_matches_one_device_on_the_same_slices(pools, kind, b, L, dp):
    for r in pools(4).run(cases.dp_exactness, kind, b, L, dp):
        assert r["sp"] == 4 // dp
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
