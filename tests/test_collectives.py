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


def test_a_lone_rank_s_collectives_are_removed_and_its_graph_computes_the_same(fake_world):
    """On an sp group of one rank every collective returns its input: ``drop_lone_collectives``
    removes each (and its wait) from a per-rank graph, on that group only, and the graph computes
    what it did (a sum of one part, an exchange with itself)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from autosp.partition import drop_lone_collectives

    fake_world(1)
    group = dist.group.WORLD.group_name

    def step(x):
        y = funcol.all_reduce(x * 2, "sum", group)
        z = funcol.all_to_all_single(y.reshape(-1), None, None, group).reshape(y.shape)
        return funcol.all_gather_tensor(z + 1, 0, group) - x

    x = torch.randn(4, 3)
    gm = make_fx(step)(x)
    c10d = lambda g: [nd for nd in g.graph.nodes if getattr(nd.target, "namespace", None) == "_c10d_functional"]  # noqa: E731
    assert len(c10d(gm)) == 6  # three collectives, three waits
    assert drop_lone_collectives(gm, "another group") == 0 and len(c10d(gm)) == 6
    assert drop_lone_collectives(gm, group) == 3 and c10d(gm) == []
    assert torch.equal(gm(x), (x * 2).reshape(-1).reshape(4, 3) + 1 - x)
