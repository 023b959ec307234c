"""Plans on a fake process group: the exact collectives autosp inserts, for any world size."""

import math
from collections import Counter

import pytest
import torch
from _checks import tier

import autosp
from examples.models import Llama, LlamaConfig

# (sp, heads, kv_heads, dim): kv heads divide sp, so K/V move at their own head count
CONFIGS = [(2, 4, 2, 64), (4, 8, 4, 64), (8, 16, 8, 128)]
L, LAYERS = 96, 2


def _plan(world, heads, kv, dim, attn, b=1, attention="auto", ulysses=None):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=heads, kv_heads=kv, dim=dim, layers=LAYERS, attn=attn))
    ids = torch.randint(0, 256, (b, L))
    with autosp.mesh(sp=world, ulysses=ulysses):
        step = autosp.shard(
            lambda input_ids, labels: model(input_ids, labels), compiler="aot_eager", attention=attention
        )
        return model, autosp.explain(step, ids, ids)


def _ulysses_expected(model, world, heads, kv, dim, b=1):
    """Hand-written Ulysses' collectives: per layer q, k, v, o all-to-all forward and their
    gradients backward; one all-reduce for the loss and one per parameter gradient."""
    hd = dim // heads
    q, k = b * L * heads * hd, b * L * kv * hd
    per_layer = [q, k, k, q]
    expected = Counter()
    for _ in range(LAYERS):
        for numel in per_layer:
            expected[("all_to_all", False, numel)] += 1
            expected[("all_to_all", True, numel)] += 1
    expected[("all_reduce", False, 1)] += 1
    for p in model.parameters():
        expected[("all_reduce", True, p.numel())] += 1
    return expected


@pytest.mark.parametrize("attn", ["sdpa", "manual"])
@pytest.mark.parametrize("world,heads,kv,dim", tier(CONFIGS, [CONFIGS[1]]))
def test_plan_is_exactly_ulysses_collectives(fake_world, world, heads, kv, dim, attn):
    """Catches any extra collective (an all-gather of an activation, a reduce-scatter instead of
    an all-to-all, a recomputed exchange) and K/V moved at the query head count. Hand-written
    attention (matmul, additive causal mask, softmax, matmul) gets the same plan as SDPA."""
    fake_world(world)
    model, plan = _plan(world, heads, kv, dim, attn)
    got = Counter((c.kind, c.backward, math.prod(c.shape)) for c in plan.collectives)
    assert got == _ulysses_expected(model, world, heads, kv, dim), str(plan)


def test_plan_bytes_are_ulysses_bytes(fake_world):
    """Bytes per rank per step equal the Ulysses formula: each all-to-all sends (N-1)/N^2 of the
    tensor; the all-reduces send 2(N-1)/N of theirs."""
    world, heads, kv, dim = CONFIGS[1]
    fake_world(world)
    model, plan = _plan(world, heads, kv, dim, "sdpa")
    n, f = world, 4
    expected = sum(
        (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n**2) * numel * f * count
        for (kind, _, numel), count in _ulysses_expected(model, world, heads, kv, dim).items()
    )
    assert plan.comm_bytes == pytest.approx(expected)


@pytest.mark.parametrize("attn", ["sdpa", "manual"])
def test_plan_sends_a_hand_written_ulysses_plans_bytes_and_nothing_beyond(fake_world, attn):
    """The plan's own reference, a hand-written Ulysses plan of the same attention (found as the
    SDPA op, or as batched matmul, softmax, batched matmul), is the formula's all-to-all bytes;
    the plan sends exactly that for activations, nothing beyond, and says so."""
    world, heads, kv, dim = CONFIGS[1]
    fake_world(world)
    model, plan = _plan(world, heads, kv, dim, attn)
    a2a = sum(
        (world - 1) / world**2 * numel * 4 * count
        for (kind, _, numel), count in _ulysses_expected(model, world, heads, kv, dim).items()
        if kind == "all_to_all"
    )
    assert plan.ulysses_bytes == pytest.approx(a2a) and plan.activation_bytes == pytest.approx(a2a)
    assert not plan.beyond_ulysses, plan.beyond_ulysses
    assert "1.00x a hand-written Ulysses plan of the same attention" in str(plan), str(plan)
    # where planning's time went (explain stops before the backend compiler)
    assert set(plan.timings) == set(autosp.backend.COMPILE_PHASES) - {"compile"}, plan.timings
    assert all(t > 0 for t in plan.timings.values()) and "\nplanned in " in str(plan), plan.timings


def test_the_backend_runs_its_recipe_each_pass_logged_with_the_graphs_it_hands_on(fake_world, monkeypatch):
    """The backend is a flat list of passes on one record (``TRAINING``; ``FORWARD_ONLY`` for a
    step under ``torch.no_grad()``): under ``AUTOSP_DEBUG=1`` each pass is logged, in the recipe's
    order, with its time and the graphs it hands on (the per-rank graph after localizing, the
    forward and backward after checkpointing)."""
    import logging
    import re

    from autosp.backend._backend import FORWARD_ONLY, TRAINING

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    monkeypatch.setenv("AUTOSP_DEBUG", "1")
    fake_world(2)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=4, kv_heads=4, dim=32, layers=1))
    ids = torch.randint(0, 256, (1, L))
    logger = logging.getLogger("autosp")
    for recipe, grad in ((TRAINING, True), (FORWARD_ONLY, False)):
        records = Records()
        logger.addHandler(records)
        try:
            with torch.set_grad_enabled(grad), autosp.mesh(sp=2):
                autosp.explain(autosp.shard(lambda i, y: model(i, y), compiler="aot_eager"), ids, ids)
        finally:
            logger.removeHandler(records)
        logged = [(m.group(1), x) for x in records.messages if (m := re.match(r"autosp pass (.+?): ", x))]
        assert [name for name, _ in logged] == [name for name, *_ in recipe], logged
        graphs = {name: len(re.findall(r"\n\d+ nodes\nclass ", x)) for name, x in logged}
        assert graphs["localize"] == 1 and "all_to_all" in dict(logged)["localize"], graphs
        assert graphs["checkpoint" if grad else "localize"] == (2 if grad else 1), graphs


def test_explain_names_each_collective_source_line(fake_world):
    """The plan says where every collective comes from, in the user's code."""
    fake_world(2)
    _, plan = _plan(*CONFIGS[0], "sdpa")
    a2a = [c for c in plan.collectives if c.kind == "all_to_all" and not c.backward]
    assert all("models.py" in c.source for c in a2a)
    assert any("scaled_dot_product_attention" in c.source or "o_proj" in c.source or "proj" in c.source for c in a2a)
    text = str(plan)
    assert "all_to_all" in text and "S(1)" in text and "MiB" in text


def test_batch_is_never_sharded(fake_world):
    """Sharding follows the annotated sequence dim: with batch 2 on sp=2 the plan is still
    Ulysses' (not data parallel over the batch, which the user did not ask for)."""
    fake_world(2)
    world, heads, kv, dim = CONFIGS[0]
    model, plan = _plan(world, heads, kv, dim, "sdpa", b=2)
    got = Counter((c.kind, c.backward, math.prod(c.shape)) for c in plan.collectives)
    assert got == _ulysses_expected(model, world, heads, kv, dim, b=2), str(plan)


def test_repeated_kv_plans_as_grouped_query_attention(fake_world):
    """K/V repeated to the query head count before SDPA (``repeat_kv``) plan the same collectives
    and the same predicted memory as SDPA on the unrepeated K/V (``enable_gqa``): the repeat is
    folded into the kernel, so neither the repeated K/V nor their gradients are built (catches a
    fold of the forward only, or none). Where the K/V heads do not split over the ranks the repeat
    stays: it is what lets the heads split."""
    fake_world(4)
    _, rep = _plan(4, 8, 4, 64, "sdpa")
    _, gqa = _plan(4, 8, 4, 64, "gqa")
    assert sum("unrepeated" in note for note in rep.notes) == LAYERS, rep.notes

    def kinds(plan):
        return Counter((c.kind, c.backward, math.prod(c.shape), c.bytes_per_rank) for c in plan.collectives)

    assert kinds(rep) == kinds(gqa)
    assert rep.memory == gqa.memory, (rep.memory, gqa.memory)
    _, kept = _plan(4, 8, 2, 64, "sdpa")
    assert not any("unrepeated" in note for note in kept.notes)
    assert {c.kind for c in kept.collectives} == {"all_to_all", "all_reduce"}


@pytest.mark.parametrize("attn", ["sdpa", "manual"])
def test_uneven_heads_plan_is_ulysses_with_an_uneven_split(fake_world, attn):
    """6 heads over 4 ranks: all-to-alls only (no all-gather of K/V), as with even heads."""
    fake_world(4)
    _, plan = _plan(4, 6, 2, 96, attn)
    kinds = {c.kind for c in plan.collectives}
    assert kinds == {"all_to_all", "all_reduce"}, kinds


def test_kv_heads_that_do_not_split_are_replicated_for_ulysses(fake_world):
    """4 query / 2 K/V heads inside SDPA (enable_gqa) on 4 ranks: the query heads split, the K/V
    heads do not; each K/V head is repeated twice before the op so that Ulysses splits the heads
    (as DeepSpeed ALST replicates them), which sends less than ring attention on the heads as they
    are (forced here) and plans no ring. The attention backward reads the K/V its forward read, in
    the same layout: one all-to-all serves both (it had run again, 6 a layer backward, 1.25x
    hand-written Ulysses), so the plan sends exactly what hand-written Ulysses sends with K/V
    repeated to 4 heads."""
    fake_world(4)
    _, plan = _plan(4, 4, 2, 64, "gqa")
    _, ring = _plan(4, 4, 2, 64, "gqa", attention="ring")
    kinds = Counter((c.kind, c.backward) for c in plan.collectives)
    assert kinds[("all_to_all", False)] == 4 * LAYERS and kinds[("all_to_all", True)] == 4 * LAYERS, kinds
    assert ("ring", False) not in kinds, kinds
    assert sum("K/V heads are replicated 2x" in note for note in plan.notes) == LAYERS, plan.notes

    def attention_bytes(p):
        return sum(c.bytes_per_rank for c in p.collectives if c.kind in ("all_to_all", "ring"))

    ratio = attention_bytes(plan) / attention_bytes(ring)
    assert ratio == pytest.approx(0.42, abs=0.01), ratio  # the figure docs/attention.md states
    hand_written = 8 * LAYERS * (L * 64 * 4) / 4 * 3 / 4  # q, k, v, o at 4 heads, each way
    assert attention_bytes(plan) == pytest.approx(hand_written)


def test_heads_that_cannot_split_run_ring_attention_by_default(fake_world):
    """2 query heads (1 K/V head) over 4 ranks: the plan keeps every activation sequence-sharded
    and runs attention as a ring (no all-to-all, no gather: whole K/V are never held on a rank);
    one ring row per attention op and pass, charged the bytes of the kernel's schedule, and
    ``explain`` says so."""
    from autosp.propagate import ring_bytes

    fake_world(4)
    model, plan = _plan(4, 2, 1, 64, "sdpa")
    kinds = Counter((c.kind, c.backward) for c in plan.collectives)
    assert set(kinds) == {("ring", False), ("ring", True), ("all_reduce", False), ("all_reduce", True)}, kinds
    assert kinds[("ring", False)] == kinds[("ring", True)] == LAYERS
    q = k = torch.empty(1, 2, L, 32)  # K/V reach the op expanded to the query heads
    fwd, bwd = ring_bytes(q, k, k, 4, True)
    assert {c.bytes_per_rank for c in plan.collectives if c.kind == "ring"} == {fwd, bwd}
    assert sum("ring attention" in note and "zigzag" in note for note in plan.notes) == LAYERS


def test_attention_kernel_can_be_forced(fake_world):
    """``attention="ring"`` runs a model whose heads split as a ring too (no all-to-all);
    "ulysses" where the heads cannot split is an error naming the op and the kernels that can run
    it; an unknown name is refused."""
    fake_world(4)
    _, plan = _plan(4, 8, 4, 64, "sdpa", attention="ring")
    assert {c.kind for c in plan.collectives} == {"ring", "all_reduce"}, str(plan)
    with pytest.raises(
        autosp.PlanError, match=r"attention='ulysses' cannot run this attention op.*'kv_gather', 'ring'"
    ):
        _plan(4, 2, 1, 64, "sdpa", attention="ulysses")
    with pytest.raises(ValueError, match="attention='zigzag'; use one of"):
        autosp.shard(lambda x: x, attention="zigzag")


def test_two_dim_sp_mesh_runs_hybrid_attention_where_heads_split_over_a_sub_group(fake_world):
    """``autosp.mesh(sp=4, ulysses=2)``: 2 query heads cannot split over 4 but do over 2, so
    attention runs hybrid (all-to-alls within the sub-groups, a ring across them: fewer bytes than
    the ring over 4); 8 heads still run as Ulysses over all 4; forcing "hybrid" without a 2D mesh
    is an error, as is a sub-group size that does not divide sp."""
    from autosp.propagate import hybrid_bytes, ring_bytes

    fake_world(4)
    _, plan = _plan(4, 2, 1, 64, "sdpa", ulysses=2)
    kinds = Counter((c.kind, c.backward) for c in plan.collectives)
    assert kinds[("hybrid", False)] == kinds[("hybrid", True)] == LAYERS and kinds[("all_to_all", False)] == 0, kinds
    q = torch.empty(1, 2, L, 32)
    assert sum(hybrid_bytes(q, q, q, 4, 2, True)) < sum(ring_bytes(q, q, q, 4, True))
    assert sum("hybrid attention" in note for note in plan.notes) == LAYERS
    _, plan = _plan(4, 8, 4, 64, "sdpa", ulysses=2)
    assert {c.kind for c in plan.collectives} == {"all_to_all", "all_reduce"}
    with pytest.raises(autosp.PlanError, match="attention='hybrid' cannot run this attention op"):
        _plan(4, 2, 1, 64, "sdpa", attention="hybrid")
    with pytest.raises(ValueError, match="ulysses=3 must divide sp=4"):
        _plan(4, 2, 1, 64, "sdpa", ulysses=3)


def test_heads_that_cannot_split_gather_kv_when_forced(fake_world):
    """2 query heads (1 K/V head) over 4 ranks with ``attention="kv_gather"``: no all-to-all and
    no gather of the query or of any activation; per layer K and V are all-gathered once forward
    (before the expansion to the query heads: at their own head count) and their gradients
    reduce-scattered backward, and ``explain`` says so."""
    fake_world(4)
    model, plan = _plan(4, 2, 1, 64, "sdpa", attention="kv_gather")
    kinds = Counter((c.kind, c.backward) for c in plan.collectives)
    assert kinds[("all_to_all", False)] == kinds[("all_to_all", True)] == 0
    assert kinds[("all_gather", False)] == 2 * LAYERS and kinds[("all_gather", True)] == 0, kinds
    assert kinds[("reduce_scatter", True)] == 2 * LAYERS and kinds[("reduce_scatter", False)] == 0, kinds
    hd = 64 // 2
    assert all(math.prod(c.shape) == L * hd for c in plan.collectives if c.kind == "all_gather"), plan
    assert all("k = " in c.source or "v = " in c.source for c in plan.collectives if c.kind == "all_gather"), plan
    assert sum("K/V are all-gathered" in note for note in plan.notes) == LAYERS


def test_explain_says_why_an_activation_is_gathered(fake_world):
    """A product of every element reads its input whole (DTensor's partial product is refused):
    the plan's note names the gathered value, the op and the user's line."""
    fake_world(2)
    emb = torch.nn.Embedding(16, 8)
    with autosp.mesh(sp=2):
        step = autosp.shard(lambda ids: emb(ids).tanh().add(1).prod(), compiler="aot_eager")
        plan = autosp.explain(step, torch.randint(0, 16, (1, 64)))
    notes = [x for x in plan.notes if "is all-gathered for aten." in x]
    # the product and its gradient (which reads the input too)
    assert notes and all("test_plan.py:" in x and "prod()" in x for x in notes), plan.notes
    assert "for aten.prod.default" in notes[0], notes
