"""A loss in chunks along the rows runs as one (``autosp.backend._unchunk``): litgpt's
``chunked_cross_entropy`` split its logits into chunks along the sharded sequence, and autosp
gathered the logits for the split. Pure tests on Dynamo's graph of a step (the rewrite's values
are the chunked ones, bit for bit; what is not row-local is left alone) and a plan test (nothing
gathered)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autosp.backend._unchunk import unchunk


def _captured(fn, *args):
    """(the rewrite's notes, its graph's targets, fn's result and gradient through the rewritten
    graph, and without it)."""
    seen = {}

    def backend(gm, example_inputs):
        gm, notes = unchunk(gm)
        seen["notes"], seen["targets"] = notes, [nd.target for nd in gm.graph.nodes]
        return gm

    torch._dynamo.reset()
    out = []
    for compiled in (torch.compile(fn, backend=backend, fullgraph=True), fn):
        xs = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
        y = compiled(*xs)
        y.backward()
        out.append((y.detach(), xs[0].grad))
    return seen["notes"], seen["targets"], out


def _litgpt(logits, labels):  # litgpt.utils.chunked_cross_entropy's chunked path
    pairs = zip(logits.split(16), labels.split(16))
    chunks = [F.cross_entropy(x, y, ignore_index=-100, reduction="none") for x, y in pairs]
    return torch.cat(chunks).sum() / (labels != -100).sum()


def _functions(logits, labels):  # torch.split and torch.chunk, a cast and a scale per chunk
    xs, ys = torch.split(logits, 10, dim=0), torch.chunk(labels, 4)
    return torch.cat([2.0 * F.cross_entropy(x.float(), y, reduction="none") for x, y in zip(xs, ys)], dim=0).mean()


def _log_softmax(logits, labels):  # per-row log-probabilities, then a row-wise product
    return torch.cat([F.log_softmax(x, dim=-1) * 0.5 for x in logits.chunk(3)]).sum()


@pytest.mark.parametrize("fn", [_litgpt, _functions, _log_softmax])
def test_a_loss_in_chunks_of_rows_runs_as_one_with_the_same_values(fn):
    """The chunks' split, their ops and the cat leave the graph; the loss and the logits'
    gradient are the chunked ones bit for bit (row by row the same computation)."""
    logits, labels = torch.randn(40, 24), torch.randint(0, 24, (40,))
    notes, targets, ((y, g), (y_ref, g_ref)) = _captured(fn, logits, labels)
    assert len(notes) == 1 and "chunks" in notes[0] and "gather nothing" in notes[0], notes
    assert not {"split", "chunk", torch.split, torch.chunk, torch.cat} & set(targets), targets
    assert torch.equal(y, y_ref) and torch.equal(g, g_ref)


def _loop_of_sums(logits, labels):  # a loop adding per-chunk sums (torchtune's chunked loss's way)
    loss = 0
    for x, y in zip(logits.split(16), labels.split(16)):
        loss = loss + F.cross_entropy(x.float(), y, reduction="sum")
    return loss / labels.numel()


def _builtin_sum(logits, labels):  # Python's sum of per-chunk sums of a row-local value
    return sum((F.log_softmax(x, dim=-1) * 0.5).sum() for x in torch.chunk(logits, 3))


@pytest.mark.parametrize("fn", [_loop_of_sums, _builtin_sum])
def test_a_sum_of_per_chunk_sums_runs_as_one_sum(fn):
    """The same terms added in another order: within float rounding of the chunked loss, the
    logits' gradient (row by row the same) bit for bit."""
    logits, labels = torch.randn(40, 24), torch.randint(0, 24, (40,))
    notes, targets, ((y, g), (y_ref, g_ref)) = _captured(fn, logits, labels)
    assert len(notes) == 1 and "summed" in notes[0], notes
    assert not {"split", "chunk", torch.split, torch.chunk} & set(targets), targets
    assert torch.allclose(y, y_ref, rtol=1e-6, atol=0) and torch.equal(g, g_ref)


def _head_in_chunks(hidden, labels, weight, cut_chunk=-1):
    """litgpt's LoRA recipe: its head in chunks of the sequence (``lm_head_chunk_size``), the last
    cut by one row for the shift, then ``chunked_cross_entropy`` of the list."""
    logits = [F.linear(x, weight) for x in hidden.split(16, dim=1)]
    logits[cut_chunk] = logits[cut_chunk][..., :-1, :]
    targets = labels[..., 1:]
    chunks = [x.reshape(-1, x.size(-1)) for x in logits]
    ys = [y.reshape(-1) for y in targets.split(logits[0].size(1), dim=1)]
    losses = [F.cross_entropy(x, y, ignore_index=-100, reduction="none") for x, y in zip(chunks, ys)]
    return torch.cat(losses).sum() / (targets != -100).sum()


@pytest.mark.parametrize("batch", [1, 2])
def test_a_head_in_chunks_with_the_last_cut_runs_as_one(batch):
    """The head's chunks (a linear layer each), the last cut by a row, flattened and through a
    per-row loss with the targets' chunks, concatenated and summed: the head and the loss on the
    whole hidden state, cut once (a batch of two flattened per chunk puts the rows in another
    order, which the sum does not read). Within float rounding of the chunked loss."""
    hidden, labels, weight = torch.randn(batch, 40, 8), torch.randint(0, 24, (batch, 40)), torch.randn(24, 8)
    notes, targets, ((y, g), (y_ref, g_ref)) = _captured(_head_in_chunks, hidden, labels, weight)
    assert len(notes) == 1 and "the last cut short" in notes[0] and "linear" in notes[0], notes
    assert not {"split", "chunk", torch.split, torch.chunk, torch.cat} & set(targets), targets
    assert torch.allclose(y, y_ref, rtol=1e-6, atol=0) and torch.allclose(g, g_ref, rtol=1e-5, atol=1e-7)


def _head_in_chunks_mean(hidden, labels, weight):  # the per-row losses of a batch of two kept in order
    logits = [F.linear(x, weight) for x in hidden.split(16, dim=1)]
    ys = labels.split(16, dim=1)
    losses = [F.cross_entropy(x.reshape(-1, 24), y.reshape(-1), reduction="none") for x, y in zip(logits, ys)]
    return (torch.cat(losses) * torch.arange(80.0)).sum()


@pytest.mark.parametrize("fn", [_head_in_chunks_mean, lambda h, y, w: _cut_first(h, y, w)])
def test_a_head_in_chunks_is_left_alone_where_row_order_matters_or_a_cut_is_elsewhere(fn):
    """Flattening a batch of two interleaves the chunks' rows: the concatenation is in another
    order than the whole's, which a weight per row reads (only a sum may take it); a cut of a chunk
    other than the last is no cut of the whole."""
    hidden, labels, weight = torch.randn(2, 40, 8), torch.randint(0, 24, (2, 40)), torch.randn(24, 8)
    notes, targets, ((y, _), (y_ref, _)) = _captured(fn, hidden, labels, weight)
    assert notes == () and ("split" in targets or torch.split in targets), targets
    assert torch.equal(y, y_ref)


def _cut_first(hidden, labels, weight):  # the first chunk cut, its targets the labels' first 15
    logits = [F.linear(x, weight) for x in hidden.split(16, dim=1)]
    logits[0] = logits[0][..., :-1, :]
    ys = labels[..., 1:].split([15, 16, 8], dim=1)
    losses = [F.cross_entropy(x.reshape(-1, 24), y.reshape(-1), reduction="none") for x, y in zip(logits, ys)]
    return torch.cat(losses).sum()


def _torchtune_chunked_output_loss(logits, labels):
    """torchtune's ``CEWithChunkedOutputLoss`` on logits chunked along the sequence: each chunk
    and its labels' chunk flattened (batch and rows), a sum of losses per chunk added with ``+=``."""
    chunks = [x.reshape(-1, x.size(-1)) for x in logits.chunk(4, dim=1)]
    ys = [y.reshape(-1) for y in labels.chunk(4, dim=1)]
    total = 0.0
    for x, y in zip(chunks, ys):
        total += F.cross_entropy(x.float(), y, ignore_index=-100, reduction="sum")
    return total / (labels != -100).sum()


@pytest.mark.parametrize("batch", [1, 2])
def test_torchtunes_chunked_loss_runs_as_one_sum(batch):
    """Its chunks flattened with the batch (a batch of two interleaves the chunks' rows, which a
    sum does not read) and added with ``+=`` (``operator.iadd`` in Dynamo's graph, once not taken
    as an addition): one sum over the whole logits, within float rounding."""
    logits, labels = torch.randn(batch, 40, 24), torch.randint(0, 24, (batch, 40))
    notes, targets, ((y, g), (y_ref, g_ref)) = _captured(_torchtune_chunked_output_loss, logits, labels)
    assert len(notes) == 1 and "summed" in notes[0] and "reshape" in notes[0], notes
    assert not {"chunk", torch.chunk} & set(targets), targets
    assert torch.allclose(y, y_ref, rtol=1e-6, atol=0) and torch.allclose(g, g_ref, rtol=1e-6, atol=1e-9)


def _weighted_sums(logits, labels):  # each chunk's sum weighed by its index: the chunks' ops differ
    pairs = enumerate(zip(logits.split(16), labels.split(16)))
    return sum((i + 1) * F.cross_entropy(x, y, reduction="sum") for i, (x, y) in pairs)


def _mean_per_chunk(logits, labels):  # a mean per chunk: not row-local (the chunks weigh alike)
    return sum(F.cross_entropy(x, y) for x, y in zip(logits.split(16), labels.split(16)))


def _across_rows(logits, labels):  # a chunk's rows mixed (a cumulative sum along them)
    return torch.cat([x.cumsum(0) for x in logits.split(16)]).sum()


def _unlike_chunks(logits, labels):  # the chunks through different ops
    parts = [F.cross_entropy(x, y, reduction="none") for x, y in zip(logits.split(16), labels.split(16))]
    return torch.cat([parts[0] * 2.0, *parts[1:]]).sum()


def _used_elsewhere(logits, labels):  # a chunk read outside its ops
    xs = logits.split(16)
    return torch.cat([F.log_softmax(x, dim=-1) for x in xs]).sum() + xs[0].sum()


def _other_cuts(logits, labels):  # paired splits at other rows (16-row and 20-row chunks of 40: 3 vs 2)
    xs, ys = logits.split(20), labels.split(20)
    zs = labels.float().split(16)[:2]
    return torch.cat([F.cross_entropy(x, y, reduction="none") * z.sum() for x, y, z in zip(xs, ys, zs)]).sum()


def _other_dim(logits, labels):  # chunks along the rows, concatenated along the classes
    return torch.cat([F.log_softmax(x, dim=-1) for x in logits.split(8)], dim=1).sum()


LEFT_ALONE = [_weighted_sums, _mean_per_chunk, _across_rows, _unlike_chunks, _used_elsewhere, _other_cuts, _other_dim]


@pytest.mark.parametrize("fn", LEFT_ALONE)
def test_chunks_that_are_not_row_local_are_left_as_they_are(fn):
    logits, labels = torch.randn(40, 24), torch.randint(0, 24, (40,))
    notes, targets, ((y, _), (y_ref, _)) = _captured(fn, logits, labels)
    assert notes == () and ("split" in targets or torch.split in targets), targets
    assert torch.equal(y, y_ref)


@pytest.mark.parametrize(
    "kind,how",
    [("llama_chunked_loss", "concatenated"), ("llama_summed_chunks", "summed"), ("llama_torchtune_chunks", "summed")],
)
def test_a_hand_written_chunked_loss_plans_ulysses_bytes_and_gathers_nothing(fake_world, kind, how):
    """Plan tier, 4 ranks, 61 tokens: a Llama whose loss is ``torch.chunk``ed in 4 along the rows
    (per-row losses concatenated, a loop adding per-chunk sums, or torchtune's form: chunks along
    the sequence, flattened, added with ``+=``) sends what a hand-written
    Ulysses plan sends (it gathered the logits before), and the plan names the rewrite."""
    import cases

    import autosp

    fake_world(4)
    model, vocab, fn = cases._lengths_model(kind)
    with autosp.mesh(sp=4):
        step = autosp.shard(lambda ids: fn(model, ids), compiler="aot_eager", dynamic=False)
        plan = autosp.explain(step, torch.randint(0, vocab, (1, 61)))
    assert "all_gather" not in {c.kind for c in plan.collectives}, str(plan)
    assert plan.activation_bytes <= 1.05 * plan.ulysses_bytes, str(plan)
    assert any(n.startswith("chunked along the sequence at") and how in n for n in plan.notes), plan.notes


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama_chunked_loss", "llama_summed_chunks", "llama_torchtune_chunks"])
def test_a_hand_written_chunked_loss_is_exact_and_split_on_two_ranks(pools, kind):
    """gloo, 2 ranks, under the defaults (Inductor, a symbolic length), 64 and 37 tokens: the loss
    and gradients within 1e-5 of one device running the chunked loss as written; nothing gathered;
    each rank's matmuls its share. (The fast tier runs litgpt's chunked loss exact: ``test_peers``.)"""
    import cases
    from _checks import assert_matmuls_split

    lengths = [64, 37]
    results = pools(2).run(cases.many_lengths, kind, lengths, 8, True, None, None, "inductor")
    for r in results:
        for loss, ref, err in r["steps"]:
            assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, r["steps"]
        assert "all_gather" not in r["kinds"], r["kinds"]
    assert_matmuls_split([{"flops": r["flops"]} for r in results], lengths[-1])


def test_a_sum_over_more_chunks_than_pythons_recursion_limit_runs_as_one():
    """1100 one-row chunks, each ``.sum()``ed and added in a loop: the additions are walked
    without recursion (a recursive walk stopped at Python's limit of 1000 frames)."""

    def many(logits, labels):
        loss = 0
        for x in logits.split(1):
            loss = loss + (x * 2.0).sum()
        return loss

    logits = torch.randn(1100, 4)
    notes, _, ((y, g), (y_ref, g_ref)) = _captured(many, logits, torch.zeros(1))
    assert len(notes) == 1 and "1100 chunks" in notes[0] and "summed" in notes[0], notes
    assert torch.allclose(y, y_ref, rtol=1e-5) and torch.equal(g, g_ref)
