"""Every redistribution the planner may insert moves the right elements to the right rank."""

import cases
import pytest

PAIRS = [
    ("S(1)", "S(2)"),
    ("S(2)", "S(1)"),
    ("S(0)", "S(2)"),
    ("S(1)", "R"),
    ("P", "R"),
    ("P", "S(1)"),
    ("R", "S(2)"),
    ("_S(0,2)", "S(1)"),
    ("S(1)", "_S(0,2)"),
    ("_S(0,2)", "R"),
    ("P", "_S(0,2)"),
    ("R", "_S(0,2)"),
    ("_S(0,2)", "_S(0,4)"),
]


# even blocks; uneven ones (7 and 5 over 2 or 4 ranks, _S(0,4) of 8 over 4: 1, 1, 0, 0); and
# blocks shorter than the number of ranks
SHAPES = [[16, 16, 12], [8, 7, 5], [4, 3, 2]]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("src,dst", PAIRS)
def test_redistribute_matches_direct_slicing(pools, world, src, dst):
    """Catches a wrong chunk order in the all-to-all or the strided shard (b blocks of s), and a
    wrong size or offset of an uneven chunk."""
    for shape in SHAPES:
        errs = pools(world).run(cases.redistribute_roundtrip, shape, src, dst, 0)
        assert max(errs) < 1e-12, shape
