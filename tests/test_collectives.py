"""Every redistribution the planner may insert moves the right elements to the right rank."""
import pytest

import cases

PAIRS = [
    ("S(1)", "S(2)"), ("S(2)", "S(1)"), ("S(0)", "S(2)"), ("S(1)", "R"), ("P", "R"), ("P", "S(1)"),
    ("R", "S(2)"), ("_S(0,2)", "S(1)"), ("S(1)", "_S(0,2)"), ("_S(0,2)", "R"), ("P", "_S(0,2)"),
    ("R", "_S(0,2)"), ("_S(0,2)", "_S(0,4)"),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("src,dst", PAIRS)
def test_redistribute_matches_direct_slicing(pools, world, src, dst):
    """Catches a wrong chunk order in the all-to-all or the strided shard (b blocks of s)."""
    shape = [16, 16, 12]
    errs = pools(world).run(cases.redistribute_roundtrip, shape, src, dst, 0)
    assert max(errs) < 1e-12
