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


# even blocks; uneven ones (7 and 5 over 2 or 4 ranks, _S(0,4) of 8 over 4: 1, 1, 0, 0); blocks
# shorter than the number of ranks; and an all-to-all between an uneven dim and an even one, the
# form a symbolic length takes (the sequence uneven, the heads even: ``_to_uneven_rows`` and
# ``_from_uneven_rows``, with and without a strided shard on the even side)
SHAPES = [[16, 16, 12], [8, 7, 5], [4, 3, 2], [4, 7, 8], [8, 7, 8]]


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


def test_one_ranks_chunk_and_start_are_the_balanced_splits_in_closed_form():
    """``chunk`` and ``chunk_start`` (one rank's rows and first row, one expression each on a
    symbolic length, where ``chunks`` and ``offsets`` build every rank's) agree with them at every
    block and rank, and, on a symbolic length, at every length the expression serves."""
    import torch
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from autosp.propagate._placement import chunk, chunk_start, chunks, even_split, offsets

    for n in (1, 2, 3, 4, 8, 64):
        for block in (0, 1, 3, n - 1, n, n + 1, 7 * n + 5, 1023, 1024):
            cs = [len(t) for t in torch.arange(block).tensor_split(n)]  # balanced, as autosp splits
            assert chunks(block, n) == cs and [chunk(block, n, i) for i in range(n)] == cs
            assert [chunk_start(block, n, i) for i in range(n)] == offsets(cs)
            assert even_split(block, n) == (len(set(cs)) == 1)
    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(37, ConstantSource("s")), hint=37)
    sym = s.node.expr
    for n in (2, 4, 8, 64):
        assert not even_split(s, n)
        for i in (0, 1, n // 2, n - 1):
            rows, start = chunk(s, n, i), chunk_start(s, n, i)
            for length in (1, 5, 37, 64, 1000, 1023):
                want = [len(t) for t in torch.arange(length).tensor_split(n)]
                got = [int(e.node.expr.subs(sym, length)) if isinstance(e, torch.SymInt) else e for e in (rows, start)]
                assert got == [want[i], offsets(want)[i]], (n, i, length)


@pytest.mark.parametrize("src,dst", [("S(1)", "S(2)"), ("S(2)", "S(1)"), ("S(1)", "R"), ("R", "S(1)")])
def test_a_symbolic_lengths_collective_traces_the_same_ops_at_8_and_64_ranks(fake_world, src, dst):
    """On a symbolic length the chunks are uneven expressions (no guard that the length divides),
    and an exchange between the sequence and the heads used to cut and join one piece per rank
    (a gather and a reduce-scatter too): at 64 ranks its trace was 64 narrows and reshapes a
    collective, and planning 4 layers took 77.8 s against 19.8 s at 8 ranks (``python -m
    benchmarks.compile_time --layers 4 --sp 8,64 --seq 1023 --kinds symbolic``). The tensor ops a
    redistribution traces are now as many at 64 ranks as at 8."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from autosp.partition._collectives import redistribute
    from autosp.propagate._placement import chunk, parse_placement, shard_spec

    def tensor_ops(n: int) -> list[str]:
        fake_world(n)
        group = dist.group.WORLD.group_name
        p, q = parse_placement(src), parse_placement(dst)
        dims = [DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.STATIC]  # the length alone
        mode = FakeTensorMode(shape_env=ShapeEnv())
        whole = mode.from_tensor(torch.randn(1, 1023, 256), symbolic_context=StatelessSymbolicContext(dims))

        def run(whole):  # rank 1's part of it (one slice at every n), then the redistribution
            x, spec = whole, shard_spec(p)
            if spec is not None:
                d = spec[0]
                x = x.narrow(d, 0, chunk(whole.shape[d], n, 1))
            return redistribute(x, p, q, n, 1, group, list(whole.shape))

        with mode:  # as AOTAutograd's partition runs (an index's arange: a fake tensor)
            gm = make_fx(run)(whole)
        return sorted(
            str(nd.target)
            for nd in gm.graph.nodes
            if nd.op == "call_function" and isinstance(nd.meta.get("val"), torch.Tensor)
        )

    assert tensor_ops(8) == tensor_ops(64)
