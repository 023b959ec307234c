"""Bad input gets an error that names the op or input, the user's line, the shapes and a fix."""

import types

import cases
import pytest
import torch

import autosp
from examples.models import Llama, LlamaConfig


def _explain(fn, *args):
    with autosp.mesh():
        return autosp.explain(autosp.shard(fn, compiler="aot_eager"), *args)


def test_empty_sequence_names_input_shape_and_fix(fake_world):
    fake_world(4)
    model = Llama(LlamaConfig())
    ids = torch.randint(0, 256, (1, 0))
    with pytest.raises(
        autosp.PlanError, match=r"input 'input_ids'.*\(1, 0\).*no sequence dim 1 to shard over sp=4.*Fix"
    ):
        _explain(lambda input_ids, labels: model(input_ids, labels), ids, ids)


@pytest.mark.parametrize(
    "seq, error, match",
    [
        ((True, True), TypeError, r"shard\(seq=\(True, True\)\).*argument name.*mapping name -> dim"),
        ({"input_ids": True}, TypeError, r"seq takes True"),
        ("input_id", ValueError, r"names \['input_id'\]: no argument of .*\['input_ids', 'labels'\]"),
        ({"tokens": 1}, ValueError, r"names \['tokens'\]"),
        (["input_ids"], None, None),  # a name of the signature: shards input_ids only
    ],
)
def test_a_seq_spec_that_shards_nothing_it_names_is_an_error(fake_world, seq, error, match):
    """Before, a tuple of flags or a misspelt name matched no argument: the step ran whole on
    every rank, replicated, with no error."""
    fake_world(2)
    model = Llama(LlamaConfig())
    ids = torch.randint(0, 256, (1, 32))

    def step(input_ids, labels):
        return model(input_ids, labels)

    def explain():
        with autosp.mesh():
            return autosp.explain(autosp.shard(step, seq=seq, compiler="aot_eager"), ids, ids)

    if error is None:
        assert explain().collectives
        return
    with pytest.raises(error, match=match):
        explain()


def test_a_step_given_no_sequence_shaped_input_is_an_error(fake_world):
    """seq=True shards dim 1 of tensors with two dims or more; a step given only 1-D tensors would
    have run whole on every rank."""
    fake_world(2)
    model = Llama(LlamaConfig())
    ids = torch.randint(0, 256, (32,))
    with pytest.raises(ValueError, match=r"shards no input of .*'ids': \(32,\).*seq=\{'name': dim\}"):
        _explain(lambda ids: model(ids[None], ids[None]), ids)


def test_a_dict_batch_is_sharded_by_its_keys(fake_world):
    """A step taking the batch as one dict (an HF collator's output) shards the tensors inside it:
    with seq=True each one's dim 1, with names its keys. Before, a dict argument was passed whole."""
    fake_world(2)
    model = Llama(LlamaConfig())
    ids = torch.randint(0, 256, (1, 32))

    def step(batch):
        return model(batch["input_ids"], batch["labels"])

    for seq in (True, ["input_ids", "labels"], {"input_ids": 1, "labels": -1}):
        with autosp.mesh():
            plan = autosp.explain(autosp.shard(step, seq=seq, compiler="aot_eager"), {"input_ids": ids, "labels": ids})
        kinds = {c.kind for c in plan.collectives}
        assert "all_to_all" in kinds and "all_gather" not in kinds, (seq, kinds)


def test_grouped_query_heads_not_splittable_names_attention_op_and_line(fake_world):
    """6 query heads over 4 ranks split unevenly (2, 2, 1, 1), which needs each query head's K/V
    head on its rank: with 2 K/V heads inside the op (enable_gqa) that cannot hold, and with a
    mask tensor the query cannot stay sequence-sharded against gathered K/V either (without one
    it does: test_exact)."""
    fake_world(4)
    proj = torch.nn.Linear(16, 6 * 8 + 2 * 2 * 8)
    mask = torch.ones(32, 32, dtype=torch.bool).tril()

    def step(x):
        b, s, _ = x.shape
        q, k, v = proj(x).split([48, 16, 16], dim=-1)
        q = q.view(b, s, 6, 8).transpose(1, 2)
        k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum()

    x = torch.randn(1, 32, 16, requires_grad=True)
    with pytest.raises(
        autosp.PlanError,
        match=r"6 query heads and 2 K/V heads.*sp=4.*flash_attention.*\(1, 6, 32, 8\).*test_errors\.py:\d+"
        r".*scaled_dot_product_attention.*Fix: repeat K/V",
    ):
        _explain(step, x)


@torch.library.custom_op("autosp_test::row_mix", mutates_args=())
def _row_mix(x: torch.Tensor) -> torch.Tensor:
    """Every row mixed with every other along dim 1: an op autosp cannot know."""
    return x.cumsum(1).flip(1)


@_row_mix.register_fake
def _(x):
    return torch.empty_like(x)


_row_mix.register_autograd(lambda ctx, g: g.flip(1).flip(1).cumsum(1).flip(1))


def test_op_without_rule_on_sharded_data_names_op_and_line(fake_world):
    """A custom op (no rule of autosp's or DTensor's) on a sequence shard: the error names the op,
    the placement, the user's line and a fix (DTensor's ``register_sharding`` among them: a
    registered custom op is exact and split, test_ops ``registered_custom_op``). Large enough that
    gathering the activation beats computing everything before it whole."""
    fake_world(2)
    emb = torch.nn.Embedding(16, 64)

    def step(ids):
        return _row_mix(emb(ids)).sum()  # an op of the user's own: no rule

    with pytest.raises(
        autosp.UnsupportedOpError,
        match=r"no sharding rule for autosp_test\.row_mix.*S\(1\).*test_errors\.py:\d+.*_row_mix\(emb.*Fix:.*"
        r"register_sharding",
    ):
        _explain(step, torch.randint(0, 16, (1, 512)))


class _Mixer(torch.nn.Module):
    def forward(self, h):
        return _row_mix(h)


def test_custom_op_without_rule_in_a_module_names_the_module_and_token_local(fake_world):
    """The same custom op inside a module (as torchtitan's ``deterministic_scatter_add`` sits in
    its MoE layer): the error names the modules it ran in, and suggests ``autosp.token_local``
    beside ``register_sharding``; at the top level (above) it suggests no mark."""
    fake_world(2)
    emb, mixer = torch.nn.Embedding(16, 64), _Mixer()

    def step(ids):
        return mixer(emb(ids)).sum()

    with pytest.raises(
        autosp.UnsupportedOpError,
        match=r"no sharding rule for autosp_test\.row_mix.*, inside .*\(_Mixer\).*Fix: if a module around it "
        r"maps each token.*autosp\.token_local\(module\).*register_sharding",
    ):
        _explain(step, torch.randint(0, 16, (1, 512)))


def test_a_median_along_the_sequence_is_gathered_and_explained(fake_world):
    """DTensor's single-dim strategy for ``median.dim`` keeps a shard only off the reduced dim:
    along the sequence the plan gathers the median's indices (64 int64, in the forward or for the
    backward's scatter: the same bytes, the solver's tie-break picks) and ``explain`` says why,
    naming the line. Before DTensor's single-dim strategies were read it was refused ("no
    sharding rule")."""
    fake_world(2)
    emb = torch.nn.Embedding(16, 64)

    def step(ids):
        return emb(ids).median(1).values.sum()  # a median along the sharded sequence

    plan = _explain(step, torch.randint(0, 16, (1, 512)))
    gathers = [c for c in plan.collectives if c.kind == "all_gather"]
    assert len(gathers) == 1, plan.collectives
    assert gathers[0].bytes_per_rank <= 64 * 8, gathers  # the indices, not the 512 x 64 activation
    assert any("int64" in n and "is all-gathered for" in n and "test_errors.py" in n for n in plan.notes), plan.notes


def test_a_returned_view_of_a_split_activation_is_gathered_where_it_is_returned(fake_world):
    """A step returning a view of a sequence-split product (a head's logits, as ``mm`` then
    ``_unsafe_view`` back to batch x sequence x vocabulary, what HF's ``lm_head`` traces to) is
    gathered once, where the step returns it, and ``explain`` says so. Gathering it one op earlier,
    for the view, sends the same bytes; the solver's tie-break took that plan, and the note then
    said the view reads the sequence whole (no exact strategy keeps it split), which is false: of
    equally cheap plans the one keeping values split further is taken (``_tie_order``)."""
    fake_world(2)
    emb, head = torch.nn.Embedding(16, 32), torch.nn.Linear(32, 24, bias=False)

    def step(ids):
        return head(emb(ids))  # (2, 64, 24): the logits returned whole, as one device returns them

    plan = _explain(step, torch.randint(0, 16, (2, 64)))
    gathers = [c for c in plan.collectives if c.kind == "all_gather"]
    assert [c.consumer for c in gathers] == ["output"], plan.collectives
    assert any("the step returns it" in n for n in plan.notes), plan.notes
    assert not any("no exact strategy of that op keeps it" in n for n in plan.notes), plan.notes


def test_a_compiler_disabled_function_in_the_step_is_named(fake_world):
    """A function wrapped with ``torch.compiler.disable`` (torchtune's ``chunked_output``) breaks
    the graph: the error names the function and the line that calls it. Before, autosp's search for
    FSDP modules crashed on the wrapper first ("'member_descriptor' object is not iterable")."""
    fake_world(2)
    emb = torch.nn.Embedding(16, 8)

    @torch.compiler.disable
    def chunked(h):
        return [c.sum() for c in h.chunk(2, 1)]

    def step(ids):
        return sum(chunked(emb(ids)))  # a disabled function called in the step

    with pytest.raises(
        autosp.GraphBreakError,
        match=r"calls \S*chunked, which is wrapped with torch\.compiler\.disable.*test_errors\.py:\d+.*sum\(chunked",
    ):
        _explain(step, torch.randint(0, 16, (1, 64)))


def test_graph_break_is_an_error_naming_the_line(fake_world):
    fake_world(2)
    emb = torch.nn.Embedding(16, 8)

    def step(ids):
        h = emb(ids)
        if h.sum().item() > 0:  # data-dependent Python control flow: cannot be one graph
            h = h * 2
        return h.sum()

    with pytest.raises(
        autosp.GraphBreakError,
        match=r"graph break\) at .*test_errors\.py:\d+.*h\.sum\(\)\.item\(\) > 0.*Fix: rewrite that line",
    ):
        _explain(step, torch.randint(0, 16, (1, 512)))


def test_a_side_effect_under_torch_utils_checkpoint_names_autosps_own_checkpointing(fake_world):
    """A layer under torch.utils.checkpoint that sets outside Python state (as transformers' hub-kernel
    wrappers do in every attention forward, gradient_checkpointing_enable()'d) cannot be one graph:
    the error says so and points to checkpoint='full', not to rewriting the line with torch ops."""
    fake_world(2)
    emb = torch.nn.Embedding(16, 8)
    state = types.SimpleNamespace(active=None)

    def layer(h):
        state.active = h.shape  # outside state, set inside the checkpointed region
        return torch.tanh(h)

    def step(ids):
        return torch.utils.checkpoint.checkpoint(layer, emb(ids), use_reentrant=False).sum()

    with pytest.raises(
        autosp.GraphBreakError,
        match=r"torch\.utils\.checkpoint.*test_errors\.py:\d+.*state\.active = .*"
        r"Fix: drop torch\.utils\.checkpoint.*checkpoint='full'",
    ):
        _explain(step, torch.randint(0, 16, (1, 512)))


def test_a_step_recompiling_past_dynamos_limit_is_an_autosp_error(fake_world):
    """A Python value the step reads that changes every call recompiles it for the same shapes;
    at Dynamo's limit that is an autosp error naming the value's guard and the fix, not Dynamo's
    "Hard failure due to fullgraph=True"."""
    fake_world(2)
    emb = torch.nn.Embedding(16, 8)
    scale = {"value": 1.0}
    ids = torch.randint(0, 16, (1, 8))
    with torch._dynamo.config.patch(recompile_limit=2), autosp.mesh(sp=2):
        step = autosp.shard(lambda ids: emb(ids).sum() * scale["value"], compiler="aot_eager")
        with pytest.raises(autosp.RecompileLimitError, match=r"recompiled 2 times.*scale.*Fix: pass the changing"):
            for i in range(3):
                scale["value"] = float(i + 2)
                step(ids)


def test_shard_outside_mesh_is_an_error():
    with pytest.raises(RuntimeError, match=r"inside `with autosp.mesh"):
        autosp.shard(lambda x: x.sum())(torch.ones(2, 4))


def test_mesh_size_mismatch_is_an_error(fake_world):
    fake_world(4)
    with pytest.raises(ValueError, match=r"sp=3 x dp=1 = 3 ranks, but the world has 4"), autosp.mesh(sp=3):
        pass


def test_a_mesh_may_be_entered_again_and_decorate(fake_world):
    """``autosp.mesh`` is re-entrant: entered again, nested, or as a decorator (a generator's
    context manager raised ``'_GeneratorContextManager' object has no attribute 'args'`` on the
    second ``with``)."""
    fake_world(2)
    m = autosp.mesh(sp=2)
    for _ in range(2):
        with m as outer:
            with m as inner:
                assert autosp.current_mesh() is inner and inner.sp_size == 2
            assert autosp.current_mesh() is outer
    assert autosp.current_mesh() is None

    @autosp.mesh(sp=2)
    def inside():
        return autosp.current_mesh().sp_size

    assert inside() == inside() == 2 and autosp.current_mesh() is None


def test_ranks_with_different_shapes_fail_with_a_message_not_a_hang(pools):
    """A rank that sees another sequence length would run other collectives: every rank gets
    the plan-mismatch error at compile time instead of a gloo hang."""
    for m in pools(2).run(cases.error_message, "llama", 1, [96, 48], True, timeout=300):
        assert "PlanError" in m and "different inputs (sp group [0, 1]: ['input_ids', 'labels']" in m, m
    # without the input check, the compile-time check of the plans catches it
    for m in pools(2).run(cases.error_message, "llama", 1, [96, 48], False, timeout=300):
        assert "PlanError" in m and "different plans" in m, m


def test_different_inputs_inside_an_sp_group_are_an_error_on_every_rank(pools):
    """A sampler over every rank instead of over the dp replicas: same shapes, so every plan and
    graph agrees, but the ranks of an sp group hold different tokens. Every rank raises the same
    error naming the fix, the ranks of the other sp groups too; dp replicas with batches of their
    own are fine; the check can be turned off (and the step then runs, on the wrong data)."""
    for msg in pools(2).run(cases.inputs_per_rank, 1, True):
        assert "PlanError" in msg and "different inputs (sp group [0, 1]: ['input_ids', 'labels'] differ" in msg, msg
        assert "num_replicas=mesh.dp_size" in msg, msg
    assert pools(4).run(cases.inputs_per_rank, 2, False) == ["no error"] * 4
    # the other sp group stops too, instead of waiting for this one in the gradients' all-reduce
    for msg in pools(4).run(cases.inputs_per_rank, 2, True):
        assert "different inputs (sp group [2, 3]: ['input_ids', 'labels'] differ" in msg, msg
    assert pools(2).run(cases.inputs_per_rank, 1, True, False) == ["no error"] * 2


def test_ranks_whose_graphs_issue_different_collectives_fail_before_running(pools):
    """The per-rank graphs differ (uneven shards, ring attention's blocks) and the partitioner
    splits each rank's on its own: graphs whose collectives differ between ranks are refused
    at compile time, on every rank, instead of hanging in the first step."""
    for msg in pools(2).run(cases.schedule_mismatch):
        assert "issue different collectives (forward, backward counts per rank: [('1', '1'), ('2', '2')])" in msg, msg


def test_a_rank_that_skips_the_step_fails_the_others_within_the_timeout():
    """No hang: rank 0 waits for rank 1 (at the input check, or without it at compile time), and
    gets an error after timeout_s."""
    from _pool import Pool

    for check, expected in (
        (True, "not every rank called this step"),
        (False, "not every rank of the sp group compiled this step within 0:00:05: rank(s) 1 did not reach"),
    ):
        pool = Pool(2, timeout_s=5)
        try:
            msgs = pool.run(cases.skip_on_rank, 1, 5.0, check, timeout=120)
        finally:
            pool.close()
        assert msgs[1] == "skipped"
        assert "PlanError" in msgs[0] and expected in msgs[0], msgs[0]


def _die_worker(rank: int, port: int, q) -> None:
    import os

    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    q.put((rank, cases.die_mid_step(1, 60.0)))


def test_a_rank_that_dies_mid_step_fails_the_others_with_an_error():
    """No hang: rank 1 exits while the ranks are in the middle of a step; rank 0, waiting on it in
    a collective, gets an autosp error saying so, within seconds (well inside the mesh's 60 s
    timeout)."""
    import torch.multiprocessing as mp
    from _pool import _free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_die_worker, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, got = q.get(timeout=180)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert rank == 0 and procs[1].exitcode == 1, (rank, got, procs[1].exitcode)
    msg = got["error"]
    assert "PlanError" in msg and "another rank stopped while this one was in a collective" in msg, msg
    assert got["seconds"] < 30, got
