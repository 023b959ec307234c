"""One compile for every sequence length: the sharded dims are symbolic (``backend._symbolic``),
so new lengths run on the step already compiled, exact; only a choice the plan makes by the
length (the number of tiles along the sequence) compiles again, once per choice."""

import random
import re
from collections import Counter

import cases
import pytest
import torch
import torch.fx as fx
from _checks import tier
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true

import autosp
from autosp._graph import known_alike
from autosp.backend._checks import cse_alike
from examples.models import Llama, LlamaConfig


def _exact(steps):
    for loss, ref, grad_err in steps:
        assert abs(loss - ref) <= 1e-5 * abs(ref) and grad_err <= 1e-5, steps


@pytest.mark.slow
def test_two_hundred_distinct_lengths_run_exact_on_two_compiles(pools):
    """200 distinct lengths (odd and even, up and down; Dynamo's recompile limit is 8) run on two
    compiled graphs, every step exact against one device; the 9th, 50th and 200th among them.
    The first length divides by the ranks, so its plan may rely on even shards: its compile is
    guarded to lengths that divide, and the first that does not compiles the second, which then
    serves every length. The work is split: this rank's matmul FLOPs are about half of one
    device's at the last length."""
    lengths = [96] + random.Random(0).sample([L for L in range(9, 210) if L != 96], 199)
    for r in pools(2).run(cases.many_lengths, "llama", lengths):
        assert len(set(lengths)) == len(r["steps"]) == 200
        _exact(r["steps"])
        assert (r["compiled"], r["graphs"]) == (1, 2), r
        # the recompile logged once, with the guard that failed and the new compile's lengths
        assert len(r["log"]) == 1 and re.fullmatch(
            rf"autosp: compiling the step again \(Dynamo's guard .*% 2\) == 0 .*failed\); symbolic sequence "
            rf"length: planned at s\d+ = {next(L for L in lengths if L % 2)} \(this compile serves .*\)",
            r["log"][0],
        ), r["log"]
        mine, one = r["flops"]
        assert mine <= 0.6 * one, r["flops"]


@pytest.mark.parametrize("kind", tier(["gpt", "hf_llama", "embed_shift_logits"], ["embed_shift_logits"]))
def test_models_run_exact_at_lengths_up_and_down_on_at_most_two_compiles(pools, kind):
    """Other models (GPT's pre-shifted labels, a Hugging Face causal LM with its own label shift, a
    loss that shifts the logits instead, so a length S - 1 is sharded;
    ``hf_qwen2`` and ``llama_gqa`` passed too, left out for the suite's time) over lengths of
    both parities, on 2 ranks: exact at every length, at most two compiles (the first length is
    even), and split by FLOPs."""
    for r in pools(2).run(cases.many_lengths, kind, [64, 37, 93, 20, 101, 58]):
        _exact(r["steps"])
        assert r["compiled"] == 1 and r["graphs"] <= 2, r
        mine, one = r["flops"]
        assert mine <= 0.6 * one, r["flops"]


_CHUNKED = [
    ("embed_chunked", list(range(17, 60)), 2),
    ("embed_chunked", [3, 33, 5, 1, 16], 3),
    ("embed_chunked_cat", [64, 37, 93, 20, 101, 58], 2),
    ("embed_chunked_ceil", [64, 37, 93, 20, 101, 58], 2),
]


@pytest.mark.parametrize(("kind", "lengths", "graphs"), tier(_CHUNKED, [_CHUNKED[1]]))
def test_a_pad_to_a_multiple_of_a_chunk_runs_exact_on_symbolic_lengths(pools, kind, lengths, graphs):
    """``F.pad(h, (0, 0, 0, (-s) % 16))`` (or by ``16 * math.ceil(s / 16) - s``, or a ``torch.cat``
    of zeros) then ``view(b, -1, 16, d)``
    and a scan within chunks (a chunked scan's layout, as Mamba-2 and chunked linear attention
    pad): its sizes are expressions of the length, which the per-rank trace builds again from the
    length's symbol. Before, the step failed inside autosp ("PythonMod(-s50, 16) is not tracked
    with proxy", and the pad's size read as a number). Exact at every length, split, on two
    graphs for the 43 lengths 17..59 (past Dynamo's recompile limit of 8; the second is
    ``guard_even_shards``': 17 pads to 2 chunks, an even number, and 33 to 3) and two for the
    others (64: the pad is empty and the cat's zero-row piece specializes Dynamo's first graph to
    multiples of 16; 64 divides by the ranks, 37 does not). Before, 3 graphs for 17..27 and 4
    for the others, and 17..59 stopped at the recompile limit at the 9th length: the halo
    schedule compared its pieces' bounds (a guard on the length's local sizes), and torch's
    contiguity and size-1 checks on a rank's rows guarded too (the per-rank trace is now
    size-oblivious on the lengths). The ranks' guards differ; each rank takes every rank's
    (``every_rank_graphs``),
    so the ranks recompile at the same lengths. Before, lengths 17, 18, ..., 27 recompiled rank 1
    alone at 19 (a reshape's contiguity check on its last chunk's rows) and both ranks stopped at
    the plan handshake's 5-minute timeout, one compiling, the other in a collective. The
    ``math.ceil`` form failed inside autosp with a raw "Cannot convert expression to float" (the
    per-rank trace rebuilt its size through a float division; now a floor division). Lengths up to
    16 are one chunk, which Dynamo guards (3, 5 and 16 on one graph, 33 on a second, 1 on a third:
    its size-1 specialization); torch's view writes that chunk's 16 rows as ``X // (X // 16)``, and
    the plan shards them (the chunk dim has one row): the per-rank trace stopped in the backward's
    flip ("... is not tracked with proxy", then a data-dependent guard on its exchanged rows).
    Sizes the guards fix are numbers now (``_graph.fixed``)."""
    for r in pools(2).run(cases.many_lengths, kind, lengths):
        _exact(r["steps"])
        assert r["compiled"] == 1 and r["graphs"] == graphs, (r["graphs"], r["log"])
        mine, one = r["flops"]
        assert mine <= 0.7 * one, r["flops"]  # 2/3: half, and the linear's half again, recomputed


def test_ranks_with_one_row_or_none_run_exact_on_a_symbolic_length(pools):
    """A loss that shifts the logits at lengths down to 2 on 2 ranks: at 2 the shifted logits have
    one row, so one rank holds none, and at 3 each rank one. The per-rank trace is size-oblivious
    on the lengths (torch's size-1 and contiguity checks take a size for more than one), so
    these are the lengths where that could go wrong: exact at every length, on 3 graphs (lengths
    whose shifted logits divide by the ranks; 2, whose one row Dynamo specializes; the others).
    Before the halo schedule kept its pieces as expressions of the length, 5 graphs."""
    for r in pools(2).run(cases.many_lengths, "embed_shift_logits", [33, 3, 2, 5, 4]):
        _exact(r["steps"])
        assert r["compiled"] == 1 and r["graphs"] == 3, r["log"]


def test_each_rank_traces_its_own_per_rank_graph_once_on_a_symbolic_length(pools):
    """On 4 ranks and a symbolic length each process traces one per-rank graph per compile, its
    own, and takes the other ranks' guards by exchange (``rank_graph``): before, every process
    traced every rank's graph for its guards (n traces a compile, 30 of 47 s of an 8-rank, 8-layer
    compile in ``benchmarks/compile_time.py``). Exact at 45 and 38 tokens (uneven shards)."""
    for r in pools(4).run(cases.traced_ranks, "embed_shift_logits", [45, 38]):
        _exact(r["steps"])
        assert r["traced"] and set(r["traced"]) == {r["rank"]}, r["traced"]
        assert len(r["traced"]) == r["graphs"], (r["traced"], r["graphs"])


def test_a_condition_is_known_as_it_was_first_answered_in_the_compile():
    """``known_alike`` answers a condition as ``statically_known_true`` first did in the compile
    (its shape env), though a guard added since makes it known: each rank's trace adds its own
    guards, and a choice of pieces read from what was known at the time differed between the
    ranks' graphs (collectives too)."""
    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(5, ConstantSource("s")), hint=5)
    assert not known_alike(s < 10) and not statically_known_true(s < 10)
    assert bool(s < 10)  # a guard: now it is known
    assert statically_known_true(s < 10) and not known_alike(s < 10)
    assert known_alike(s > 0) and not known_alike(s > 5)  # others are asked afresh, once


def _two_exchanges(alike: bool) -> fx.GraphModule:
    """Two all-to-alls, of one tensor (``alike``: merged by CSE into one) or of two."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = x if alike else g.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    a2a, wait = torch.ops._c10d_functional.all_to_all_single.default, torch.ops._c10d_functional.wait_tensor.default
    outs = [g.call_function(wait, (g.call_function(a2a, (t, [1, 1], [1, 1], "0")),)) for t in (x, y)]
    g.output(g.call_function(torch.ops.aten.add.Tensor, tuple(outs)))
    return fx.GraphModule(torch.nn.Module(), g)


def _exchanges(gm: fx.GraphModule) -> int:
    return sum(nd.target is torch.ops._c10d_functional.all_to_all_single.default for nd in gm.graph.nodes)


def test_common_subexpressions_merge_only_where_every_rank_merges_the_same_collectives():
    """``cse_alike``: a rank's graph is merged (AOTAutograd's CSE) where every rank's merged graph
    issues the same collectives, else kept whole. Falcon-H1 on a symbolic length stopped at the
    schedule check (the ranks would have hung) where the partitioner merged one rank's two
    exchanges alone."""
    merged = cse_alike([_two_exchanges(True), _two_exchanges(True)], 0)
    assert _exchanges(merged) == 1
    for rank in (0, 1):
        assert _exchanges(cse_alike([_two_exchanges(True), _two_exchanges(False)], rank)) == 2


def test_static_lengths_compile_once_each_under_the_recompile_limit(pools):
    """With dynamic=False each new length compiles a step of its own (logged once, with what
    changed), so the 4th distinct length under a recompile limit of 2 runs, exact, and a length
    seen before reuses its step."""
    for r in pools(2).run(cases.many_lengths, "embed", [5, 9, 12, 7, 9], 2, False):
        _exact(r["steps"])
        assert (r["compiled"], r["graphs"]) == (4, 4), r
        assert r["log"] == [
            f"autosp: new input shapes (ids (1, {a}) -> (1, {b})): compiling the step for them"
            for a, b in ((5, 9), (9, 12), (12, 7))
        ], r["log"]


def test_the_tile_count_is_the_one_choice_that_recompiles(pools):
    """Tiled along the sequence (8 rows a tile at least), a symbolic length compiles once per
    tile count (1, 2, 4 or 8 tiles: rows per rank 15, 21-26, 36-46), not once per length; each
    call runs the compile for its count, and ``step.plan`` is that compile's. The lengths are odd
    but the last, which the odd lengths' compile for its count serves."""
    lengths = [41, 71, 51, 29, 91, 50]
    for r in pools(2).run(cases.many_lengths, "embed", lengths, 8, True, 8):
        _exact(r["steps"])
        assert (r["compiled"], r["graphs"], len(r["log"])) == (1, 3, 2), r
        tiles = [rung.rsplit(", ", 1)[-1] if "tiles" in rung else "untiled" for rung in r["rungs"]]
        assert tiles == ["2 tiles", "4 tiles", "2 tiles", "untiled", "4 tiles", "2 tiles"], r["rungs"]


@pytest.mark.parametrize(("attn", "world"), tier([("sdpa", 2), ("gqa", 4)], [("sdpa", 2)]))
def test_a_symbolic_plan_is_the_static_plan_at_its_length(fake_world, attn, world, L=93):
    """The plan a symbolic compile makes (at the length it is first called with) moves what the
    static plan moves: the same collectives, each of the same bytes, forward and backward (the
    solver may put an all-to-all of equal cost on another edge of a view chain: the symbolic graph
    has its sizes as nodes, so ties break otherwise), and it says the length it was made at.
    Grouped-query heads inside SDPA (``enable_gqa``) on 4 ranks, where replicating the K/V heads
    is priced against a ring: before, the pricing read the symbolic graph's sizes and failed
    ("unhashable type: non-nested SymInt")."""
    fake_world(world)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(attn=attn))
    ids = torch.randint(0, 256, (1, L))
    plans = {}
    with autosp.mesh(sp=world):
        for dynamic in (True, False):
            step = autosp.shard(lambda a, b: model(a, b), compiler="aot_eager", dynamic=dynamic)
            plans[dynamic] = autosp.explain(step, ids, ids)
    sym, static = plans[True], plans[False]

    def moved(plan):
        return Counter((c.kind, c.bytes_per_rank, c.backward) for c in plan.collectives)

    assert moved(sym) == moved(static) and sym.comm_bytes == static.comm_bytes
    # the symbol, and the lengths the compile serves: all (its rung, untiled, was taken without
    # weighing tiled ones, so the tile count is no choice of this compile)
    assert any(re.search(rf"planned at s\d+ = {L} \(this compile serves \d <= s\d+\)", x) for x in sym.notes), sym.notes
    assert not any("symbolic" in note for note in static.notes)


@pytest.mark.slow
def test_ring_attention_plans_on_a_symbolic_length(fake_world):
    """Fewer query heads (2) than ranks (4) run ring attention, whose key count is a node of the
    symbolic graph (the checkpointing pass's FLOP count read it as a number, and failed); the
    plan at 97 tokens is the static plan's, ring passes included."""
    fake_world(4)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=2, kv_heads=1))
    ids = torch.randint(0, 256, (1, 97))
    plans = {}
    with autosp.mesh(sp=4):
        for dynamic in (True, False):
            step = autosp.shard(lambda a, b: model(a, b), compiler="aot_eager", dynamic=dynamic)
            plans[dynamic] = autosp.explain(step, ids, ids)
    kinds = Counter(c.kind for c in plans[True].collectives)
    assert kinds == Counter(c.kind for c in plans[False].collectives) and kinds["ring"] > 0, kinds
    assert plans[True].comm_bytes == pytest.approx(plans[False].comm_bytes, rel=1e-9)


@pytest.mark.slow
def test_a_budget_takes_at_each_length_the_rung_a_static_compile_takes_on_a_compile_per_rung(pools):
    """``checkpoint=<bytes>`` on a symbolic length: the rung is the one a static compile at that
    length takes (the budget's peaks of every rung are read at other lengths from the same
    graphs, on every rank, and the compile guarded to the lengths its rung holds for), on one
    compile per rung (3 here, one of them the odd lengths'), not one per length (6); exact.
    Before, the ranks built checkpointing ladders of different lengths (their per-rank graphs
    differ on a symbolic length) and the step stopped with a PlanError; and the rung of the
    first length ran at every length, past the budget at longer ones."""
    lengths, budget = [256, 250, 200, 120, 264, 256, 201], 1_100_000
    symbolic = pools(2).run(cases.many_lengths, "llama", lengths, 8, True, None, budget)
    static = pools(2).run(cases.many_lengths, "llama", lengths, 8, False, None, budget)
    for r, s in zip(symbolic, static):
        _exact(r["steps"])
        assert r["rungs"] == s["rungs"] and len(set(r["rungs"])) == 3, (r["rungs"], s["rungs"])
        assert (r["compiled"], r["graphs"], s["graphs"]) == (1, 3, 6), r
        assert all(any("checkpoint budget: rung" in n for n in notes) for notes in r["notes"]), r["notes"]


def test_auto_on_a_symbolic_length_takes_the_rung_of_a_longer_one(fake_world, L=128):
    """``checkpoint="auto"`` on a symbolic length takes one rung for every length, weighed at
    ``AUTO_LONGER`` (16) times the first length, where the rungs' memory differs: at 128 tokens
    on 2 ranks every rung but the one that recomputes least costs over 10% of the step, so the
    static plan keeps 'none'; the symbolic compile takes the rung the static compile at 2048
    takes, and each rung's peak it reads at 2048 from its own graphs is what the static compile
    at 2048 predicts for that rung. Before, the symbolic compile took the first length's 'none'
    for every length: at 2048 tokens, 1.2x the memory of the rung it takes now."""
    fake_world(2)
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    plans = {}
    with autosp.mesh(sp=2):
        for dynamic, length in ((True, L), (False, L), (False, 16 * L)):
            ids = torch.randint(0, 256, (1, length))
            step = autosp.shard(lambda a, b: model(a, b), compiler="aot_eager", dynamic=dynamic)
            plans[dynamic, length] = autosp.explain(step, ids, ids).checkpoint
    sym, short, long = plans[True, L], plans[False, L], plans[False, 16 * L]
    assert short.chosen == "none" and sym.chosen == long.chosen != "none", (sym, short, long)
    static = {r.name: r.memory.peak for r in long.rungs}
    read = {r.name: r.longer[1] for r in sym.rungs if r.name in static}
    assert {r.longer[0] for r in sym.rungs} == {16 * L} and len(read) >= 3, sym
    assert all(abs(read[k] - static[k]) <= 0.02 * static[k] for k in read), (read, static)
    assert static["none"] >= 1.2 * static[sym.chosen], static
