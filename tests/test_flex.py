"""FlexAttention (``torch.nn.attention.flex_attention``, torchtitan's attention) with block masks
built outside the step: causal, a causal sliding window and packed documents, with no score
function, a soft-cap or ALiBi (a captured per-head tensor). Planned on a fake process group
(Ulysses by default, K/V gather where the heads do not split or when forced, the op whole where
its score function reads a learned tensor), the per-rank block mask against torch's own for the
rank's rows, and exact on gloo against one device (fp32, 1e-5), with each rank's matmul FLOPs at
most 1.25/N of one device's and no (L, L) tensor on a rank under K/V gather.

torch 2.13 cannot lower FlexAttention's backward for a CPU under Inductor (a single device's
``torch.compile`` fails too), so these run ``aot_eager``, on symbolic lengths."""

from __future__ import annotations

import math

import cases
import pytest
import torch
from flex_models import BLOCK, FlexLlama, block_mask, documents
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

import autosp
from autosp.errors import PlanError
from autosp.partition._flex import rows_block_mask
from autosp.propagate._flex import BLOCK_MASK
from examples.models import LlamaConfig

L = 64


def _plan(world, heads=4, kv_heads=2, score="alibi", attention="auto", learned=False):
    torch.manual_seed(0)
    model = FlexLlama(LlamaConfig(heads=heads, kv_heads=kv_heads), score=score)
    if learned:  # a learned per-head bias read by the score function
        model.slopes = torch.nn.Parameter(model.slopes.clone())
    ids = torch.randint(0, 256, (1, L))
    with autosp.mesh(sp=world):
        step = autosp.shard(lambda i, labels, m: model(i, labels, m), compiler="aot_eager", attention=attention)
        return autosp.explain(step, ids, ids, block_mask("documents", L, documents(L)))


def _flex_notes(plan):
    return [x for x in plan.notes if x.startswith("FlexAttention")]


def test_flex_attention_plans_as_ulysses_where_heads_split(fake_world):
    fake_world(2)
    plan = _plan(2)
    kinds = {c.kind for c in plan.collectives}
    assert kinds == {"all_to_all", "all_reduce"}, str(plan)
    assert not _flex_notes(plan), plan.notes


def test_flex_attention_replicates_kv_heads_where_only_they_do_not_split(fake_world):
    """4 query / 2 K/V heads over 4 ranks: the K/V heads are replicated 2x before the op (as for
    SDPA), and the plan is Ulysses', byte for byte."""
    fake_world(4)
    plan = _plan(4)
    assert {c.kind for c in plan.collectives} == {"all_to_all", "all_reduce"}, str(plan)
    notes = [x for x in plan.notes if "K/V heads are replicated 2x" in x and "gathering K/V" in x]
    assert len(notes) == 2, plan.notes
    assert any("1.00x a hand-written Ulysses plan" in x for x in plan.notes), plan.notes


def test_flex_attention_gathers_kv_where_heads_do_not_split(fake_world):
    """2 query / 1 K/V heads over 4 ranks: the query rows stay sharded, K/V are all-gathered (and
    nothing else is whole: the gathers are K/V's, the reduce-scatters their gradients')."""
    fake_world(4)
    plan = _plan(4, heads=2, kv_heads=1)
    gathered = [c for c in plan.collectives if c.kind == "all_gather"]
    assert gathered and all(math.prod(c.shape) == L * 32 for c in gathered), str(plan)
    notes = _flex_notes(plan)
    assert len(notes) == 2 and all("K/V are all-gathered" in x for x in notes), notes
    assert "all_to_all" not in {c.kind for c in plan.collectives}, str(plan)


def test_flex_attention_with_a_learned_score_tensor_is_refused_with_the_fix(fake_world):
    fake_world(2)
    with pytest.raises(PlanError, match="learned bias") as e:
        _plan(2, learned=True)
    assert "flex_models.py" in str(e.value) and "buffer" in str(e.value)


def _rank_mask(whole, start: int, rows: int, block: int = BLOCK):
    """(its fields, the block mask, the offset mask function) ``rows_block_mask`` makes for rows
    ``start .. start + rows`` of ``whole`` (of sparse blocks ``block``)."""
    mask_mod = whole.mask_mod

    def shifted(b, h, q, kv):
        return mask_mod(b, h, q + start, kv)

    t = dict(zip(BLOCK_MASK, rows_block_mask(dict(zip(BLOCK_MASK, whole.as_tuple())), start, rows, shifted)))
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    mine = BlockMask.from_kv_blocks(
        *(t[f] for f in fields), BLOCK_SIZE=BLOCK, mask_mod=shifted, seq_lengths=(rows, t["kv_len"])
    )
    return t, mine, shifted


def _blocks(mask: BlockMask, full: bool, rows: int, S: int) -> torch.Tensor:
    """The (rows, S) entries a block mask lists (its full blocks only, with ``full``)."""
    if full and mask.full_kv_num_blocks is None:
        return torch.zeros(rows, S, dtype=torch.bool)
    m = BlockMask.from_kv_blocks(
        mask.full_kv_num_blocks if full else mask.kv_num_blocks,
        mask.full_kv_indices if full else mask.kv_indices,
        BLOCK_SIZE=BLOCK,
        seq_lengths=(rows, S),
    )
    return m.to_dense().repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :rows, :S].bool()


@pytest.mark.parametrize("kind", ["causal", "window", "documents"])
@pytest.mark.parametrize("start,rows", [(0, 48), (48, 48), (96, 64), (0, 40), (48, 40), (40, 50), (7, 30)])
def test_a_ranks_block_mask_is_torchs_block_mask_of_its_rows(kind, start, rows):
    """Where the rank's first row starts a block and its rows end on one (or at the end), its block
    tensors are bit for bit ``create_block_mask`` of its rows (the mask function offset by
    ``start``); where they end mid-block, the global mask's blocks (a superset, the same full
    ones); where they start mid-block, every block partial. Each way sound: every entry the mask
    lets through lies in a listed block, and every block listed full is wholly let through."""
    S = 160
    whole = block_mask(kind, S, documents(S))
    t, mine, shifted = _rank_mask(whole, start, rows)
    assert (t["q_len"], t["kv_len"]) == (rows, S)
    exact = create_mask(shifted, None, None, rows, S, device="cpu")
    if start % BLOCK == 0 and (rows % BLOCK == 0 or start + rows == S):
        want = create_block_mask(shifted, None, None, rows, S, device="cpu", BLOCK_SIZE=BLOCK)
        for f, w in zip(BLOCK_MASK, want.as_tuple()):
            if isinstance(w, torch.Tensor):
                assert torch.equal(t[f], w), f
    elif start % BLOCK:
        assert t["full_kv_num_blocks"] is None and (t["kv_num_blocks"] == (S + BLOCK - 1) // BLOCK).all()
    assert not (exact & ~(_blocks(mine, False, rows, S) | _blocks(mine, True, rows, S))).any()
    if mine.full_kv_num_blocks is not None:
        assert not (_blocks(mine, True, rows, S) & ~exact).any()


def test_a_ranks_block_mask_gives_its_rows_of_attention_where_the_kernel_reads_the_blocks():
    """Inductor's CPU FlexAttention kernel reads the block tables (a table listing no block gives
    other values; the eager implementation reads only the mask function): a rank's rows of
    attention through its own block mask, sliced or every block partial, are the whole
    sequence's attention at those rows (forward; a CPU cannot compile the backward)."""
    S, H, D = 160, 2, 16
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D) for _ in range(3))
    whole = block_mask("documents", S, documents(S))
    ref = flex_attention(q, k, v, block_mask=whole)
    compiled = torch.compile(flex_attention)
    for start, rows in [(48, 48), (0, 40), (40, 50)]:
        t, mine, _ = _rank_mask(whole, start, rows)
        empty = BlockMask.from_kv_blocks(
            torch.zeros_like(t["kv_num_blocks"]),
            t["kv_indices"],
            BLOCK_SIZE=BLOCK,
            mask_mod=mine.mask_mod,
            seq_lengths=(rows, S),
        )
        with torch.no_grad():
            got = compiled(q[:, :, start : start + rows], k, v, block_mask=mine)
            none = compiled(q[:, :, start : start + rows], k, v, block_mask=empty)
        want = ref[:, :, start : start + rows]
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (start, rows)
        assert (none - want).abs().max() > 0.1, (start, rows)  # the kernel reads the tables


def _exact_and_split(results, world, lengths):
    for r in results:
        for loss, ref, err in r["steps"]:
            assert abs(loss - ref) <= 1e-5 * abs(ref) and err <= 1e-5, r["steps"]
    mine, single = [r["flops"][0] for r in results], results[0]["flops"][1]
    assert single > 0 and max(mine) <= 1.25 * single / world, (mine, single)


def test_packed_documents_through_flex_attention_are_exact_on_2_ranks_with_no_rank_holding_the_mask(pools):
    """3 packed documents, ALiBi, K/V gathered (forced), a new length each step (64, 37, 50, 61:
    even and odd shards, a rank's first row starting a block or not): exact, split, no (L, L)
    tensor on a rank, and the block mask passed in follows the symbolic length: a compile for
    even shards, one for odd, one where rank 1's rows start mid-block (not one per length)."""
    lengths = [64, 37, 50, 61]
    results = pools(2).run(cases.flex_exactness, "documents", lengths, "alibi", "kv_gather", "aot_eager", True)
    _exact_and_split(results, 2, lengths)
    assert all(0 < r["rows"] <= 31 for r in results), [r["rows"] for r in results]
    assert all(r["graphs"] <= 3 for r in results), [r["graphs"] for r in results]
    assert ("all_gather", "S(2)", "R", 4) in results[0]["kinds"], results[0]["kinds"]


# each mask with one score function (every score function twice), "auto" and K/V gather forced
MASKS = [("causal", "none"), ("window", "softcap"), ("documents", "alibi"), ("heads", "alibi"), ("none", "softcap")]
CASES = [(m, sc, a) for m, sc in MASKS for a in ("auto", "kv_gather")]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mask,score,attention", CASES)
def test_flex_attention_is_exact_and_split(pools, world, mask, score, attention):
    """Exact, split, and under K/V gather no (L, L) tensor on a rank; "heads" has a block mask
    per head (split with the heads under Ulysses), "none" no block mask (flex_attention's own)."""
    lengths = [64, 37]
    results = pools(world).run(cases.flex_exactness, mask, lengths, score, attention, "aot_eager", True)
    _exact_and_split(results, world, lengths)
    # 2 K/V heads split over 2 ranks; over 4 they are replicated 2x, and Ulysses splits the heads
    if attention == "kv_gather":
        # no (..., L, L) tensor: the most rows of an (..., rows, L) one is a rank's share, or K
        # transposed for the scores (the head dim, 16)
        assert all(r["rows"] <= max(-(-37 // world), 16) for r in results), [r["rows"] for r in results]
        assert "all_to_all" not in {k for k, *_ in results[0]["kinds"]}, results[0]["kinds"]
    else:
        assert {k for k, *_ in results[0]["kinds"]} == {"all_to_all", "all_reduce"}, results[0]["kinds"]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["auto", "kv_gather"])
def test_flex_attention_over_two_sequences_with_their_own_documents_is_exact(pools, attention):
    """Two sequences a batch, each packed with its own documents: a block mask per sequence."""
    results = pools(2).run(cases.flex_exactness, "documents", [64, 37], "alibi", attention, "aot_eager", True, 4, 2, 2)
    _exact_and_split(results, 2, [64, 37])


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["auto", "kv_gather"])
def test_flex_attention_whose_log_sum_exp_is_read_is_exact(pools, attention):
    """``return_lse=True`` with the log-sum-exp weighting the output: its gradient reaches the
    backward op (``grad_logsumexp``), split as the query rows or heads are."""
    results = pools(2).run(
        cases.flex_exactness, "documents", [64, 37], "alibi", attention, "aot_eager", True, 4, 2, 1, "cpu", True
    )
    _exact_and_split(results, 2, [64, 37])


def test_flex_attention_costs_its_flops_in_the_checkpointing_pass():
    """4·B·H·Sq·Sk·D forward, 2.5 times that backward (dense: its block sparsity is data)."""
    from torch._higher_order_ops.flex_attention import flex_attention as hop
    from torch.fx.experimental.proxy_tensor import make_fx

    from autosp.partition._checkpoint import _flops, _kind

    B, H, S, D = 1, 4, 32, 8
    bm = block_mask("causal", S)

    def fwd(q, k, v):
        return hop(q, k, v, lambda s, b, h, qi, kv: s, bm.as_tuple(), 0.5, {}, (), ())

    q = torch.randn(B, H, S, D)
    gm = make_fx(fwd)(q, q, q)
    (nd,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]
    assert _flops(nd) == 4.0 * B * H * S * S * D and _kind(nd) == "attention"


def test_a_block_mask_input_travels_as_its_tables_and_is_rebuilt_whole():
    """``backend._block_masks``: the masks among the inputs (in tuples, named tuples, lists and
    dicts) become carriers whose lengths are tensor sizes, and come back equal; inputs holding
    none are passed on as they are."""
    from collections import namedtuple

    from autosp.backend._block_masks import BlockMaskInput, block_mask_inputs, rebuilt

    Pair = namedtuple("Pair", "mask n")
    bm = block_mask("documents", 64, documents(64))
    batch = {"ids": torch.ones(2)}
    args, kwargs = block_mask_inputs((Pair(bm, 3), [bm], batch), {"m": bm})
    assert isinstance(args[0].mask, BlockMaskInput) and isinstance(kwargs["m"], BlockMaskInput)
    assert args[2] is batch
    assert tuple(args[0].mask.rows.shape) == (64, 0) and tuple(args[0].mask.cols.shape) == (0, 64)
    back, kw = rebuilt(args, kwargs)
    for m in (back[0].mask, back[1][0], kw["m"]):
        assert m.seq_lengths == (64, 64) and m.BLOCK_SIZE == bm.BLOCK_SIZE and m.mask_mod is bm.mask_mod
        assert all(torch.equal(a, b) for a, b in zip(m.as_tuple()[2:10], bm.as_tuple()[2:10]))
