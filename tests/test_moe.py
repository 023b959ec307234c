"""Mixture-of-experts layers users write by hand (``cases.TopKMoE``): marked with
``autosp.token_local``, each rank routes and computes its own tokens; unmarked, their dispatch
(``torch.where``, ``index_add_``) is refused with an error that names the op and the mark."""

import cases
import pytest
import torch
from _checks import assert_exact, assert_matmuls_split

import autosp


@pytest.mark.parametrize("form", ["where", "sort"])
def test_a_handwritten_topk_moe_marked_token_local_is_exact_and_split(pools, form):
    """Softmax router, top 2, no capacity, dispatch by ``torch.where`` + ``index_add_`` or by
    sort + ``bincount`` + ``split`` (Python counts: data-dependent code Dynamo never traces, as
    the op runs it per rank): loss and every gradient one device's, every matmul split (the
    experts' included), and no collective but attention's all-to-alls, the gradients' all-reduce
    and the shifted loss's halo (one row). 2 sequences of 61 tokens: uneven shards of a flattened
    batch."""
    results = pools(2).run(cases.handwritten_moe, form, "token_local", 2, 61)
    assert_matmuls_split(results, 61)
    for r in results:
        assert_exact(r)
        assert r["kinds"] == ["all_reduce", "all_to_all", "halo"], r["kinds"]


def test_a_handwritten_moe_pinned_replicated_runs_its_data_dependent_counts_exactly(pools):
    """The error's other fix: the layer's tokens pinned replicated (``autosp.annotate``). Its
    ``torch.where`` counts are data-dependent sizes (unbacked symbols), which the per-rank graph
    reads from its own trace and no strategy shards (their split is unknown before the data).
    Before, the step failed inside autosp ("u0 >= 0 is not tracked with proxy"). The plan gathers
    the layer's tokens, as asked: pinned here."""
    for r in pools(2).run(cases.handwritten_moe, "where", "replicated", 2, 61):
        assert_exact(r)
        assert r["counts"] == ["R"], r["counts"]
        assert r["kinds"] == ["all_gather", "all_reduce", "all_to_all", "halo"], r["kinds"]


def test_a_handwritten_topk_moe_unmarked_is_refused_naming_index_add_and_the_mark(fake_world):
    """Without the mark the dispatch has no rule on sharded tokens: an error naming the op, the
    line and ``autosp.token_local``, not a silently gathered or wrong plan."""
    fake_world(2)
    model = cases.MoEModel("where", None)
    ids = torch.randint(0, 128, (1, 64))
    with (
        autosp.mesh(),
        pytest.raises(
            autosp.UnsupportedOpError, match=r"index_add.*cases\.py:\d+.*index_add_.*autosp\.token_local\(module\)"
        ),
    ):
        autosp.explain(autosp.shard(lambda i: model(i, i), compiler="aot_eager"), ids)


class _WithAuxLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x), x.pow(2).mean()


def test_token_local_refuses_a_module_that_returns_more_than_its_tokens():
    """A module returning an auxiliary loss with its tokens (a mean over all tokens: not
    token-local) is refused when it runs, not returned as each rank's own mean."""
    module = autosp.token_local(_WithAuxLoss())
    x = torch.randn(2, 5, 8)
    assert torch.equal(module(x)[0], module.lin(x))  # outside compile: the module's own forward
    with pytest.raises(NotImplementedError, match=r"_WithAuxLoss, run token-local, returned tuple.*auxiliary loss"):
        torch.compile(module, backend="aot_eager", fullgraph=True)(x)


def test_no_strategy_shards_a_data_dependent_count():
    """A tensor whose rows ``nonzero`` counted (an MoE's ``torch.where`` dispatch) is offered
    sharded along them: every rule's answer is replicated there, in and out. Before, the
    elementwise rule guarded on the count (GuardOnDataDependentSymNode) and a rule from DTensor
    could have split rows whose per-rank count is unknown before the data."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autosp.propagate._placement import R, shard
    from autosp.propagate._rules import strategies_for

    def f(mask, w):
        rows = torch.nonzero(mask)[:, 0]
        return (rows.float()[:, None] * w).sum()

    gm = make_fx(f, tracing_mode="symbolic")(torch.ones(8, 2, dtype=torch.bool), torch.ones(4))
    mul = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    found = strategies_for(mul, [frozenset({R, shard(0)}), frozenset({R})], 2)
    assert [(s.outs, s.ins) for s in found] == [((R,), (R, R))]


def test_a_token_local_ops_working_set_is_measured_affine_in_rows_and_leaves_the_rng_alone():
    """The memory model runs a token-local op's function on its own parameters at 2 small row
    counts for what it allocates and frees inside (the liveness walk sees the op's inputs and
    outputs only). ``tanh(h @ w) * rand_like(h)``, d = 16: 2 float temporaries of d per row live at
    once besides the output, 128 bytes per row and nothing fixed; the backward's are more (its
    function run again under ``vjp``). The run draws random numbers, and must not move the step's
    RNG; with fake parameters (a plan without a model) nothing runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autosp.partition._memory import _working_set_fit
    from autosp.propagate._local import register

    d = 16
    w = torch.randn(d, d, requires_grad=True)
    key = register(lambda h, w, scratch: torch.tanh(h @ w) * torch.rand_like(h), ("working set", w), (w,))
    per_row = (((d,), torch.float32),)
    state = torch.get_rng_state()
    assert _working_set_fit(key, per_row, None) == (0.0, 8 * d)
    assert torch.equal(torch.get_rng_state(), state)
    fixed, per = _working_set_fit(key, (((d,), torch.float32), *per_row), (True, True))
    assert per > 8 * d, (fixed, per)
    with FakeTensorMode():
        fake = register(lambda h, w, scratch: h @ w, ("fake", d), (torch.empty(d, d),))
    assert _working_set_fit(fake, per_row, None) == (0.0, 0.0)
