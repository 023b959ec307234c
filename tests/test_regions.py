"""Repeated blocks captured once (``autosp/backend/_regions.py``): alike blocks outlined into one
``invoke_subgraph`` before AOTAutograd, and any ``invoke_subgraph`` (a user's
``torch.compiler.nested_compile_region`` too) inlined into the joint graph autosp plans."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import operator
from collections import Counter

import cases
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

import autosp
from autosp.backend._regions import outline_blocks
from examples.models import Llama, LlamaConfig


def _moved(plan) -> Counter:
    return Counter((c.kind, c.bytes_per_rank, c.backward) for c in plan.collectives)


def _explain(model, world: int, L: int, **options):
    ids = torch.randint(0, 256, (1, L), generator=torch.Generator().manual_seed(0))
    with autosp.mesh(sp=world):
        step = autosp.shard(lambda a, b: model(a, b), compiler="aot_eager", **options)
        return autosp.explain(step, ids, ids)


@pytest.mark.parametrize("dynamic", [True, False], ids=["symbolic", "static"])
def test_blocks_captured_once_plan_as_every_block_traced(fake_world, dynamic):
    """The example Llama (4 layers, 4 ranks) with its blocks captured once (the default) is planned
    as with every block traced (``blocks_once=False``): the same collectives, each of the same
    bytes, and the same checkpointing ladder (rungs, predicted peaks and overheads), and the plan
    says the 4 blocks were captured once. Would catch a block's copy left with the module stack
    of the block it was traced at (the checkpointing pass would see one layer where there are
    four), or an output of a block lost in the outlining."""
    fake_world(4)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=4, kv_heads=4, layers=4))
    once = _explain(model, 4, 96, dynamic=dynamic)
    torch._dynamo.reset()
    each = _explain(model, 4, 96, dynamic=dynamic, blocks_once=False)
    assert _moved(once) == _moved(each) and once.comm_bytes == each.comm_bytes
    assert str(once.checkpoint) == str(each.checkpoint) and once.memory == each.memory
    assert [n for n in once.notes if "captured once" in n] == [
        "4 blocks LlamaBlock (blocks.0, ...) captured once (one subgraph traced for all), then planned as one graph"
    ], once.notes
    assert not any("captured once" in n for n in each.notes)


def test_flex_attention_blocks_are_captured_once_and_planned_as_traced_each(fake_world):
    """Blocks holding FlexAttention (a higher-order op with its score and mask functions as
    subgraphs; torchtitan's default attention) with ALiBi and a causal block mask, 3 layers on 2
    fake ranks: captured once (each block's functions compared by their code), and planned as
    with every block traced."""
    import flex_models

    fake_world(2)
    torch.manual_seed(0)
    model = flex_models.FlexLlama(LlamaConfig(heads=4, kv_heads=4, layers=3), score="alibi")
    ids = torch.randint(0, 256, (1, 64))
    mask = flex_models.block_mask("causal", 64, block=16)
    plans = []
    for once in (True, False):
        torch._dynamo.reset()
        with autosp.mesh(sp=2):
            step = autosp.shard(lambda a, b, c: model(a, b, c), compiler="aot_eager", blocks_once=once)
            plans.append(autosp.explain(step, ids, ids, mask))
    once, each = plans
    assert any(n.startswith("3 blocks LlamaBlock (blocks.0, ...) captured once") for n in once.notes), once.notes
    assert _moved(once) == _moved(each) and str(once.checkpoint) == str(each.checkpoint)


@pytest.mark.slow
def test_a_32_layer_model_captured_once_is_planned_as_traced_each(fake_world):
    """The issue's bar: a 32-layer Llama (8 ranks, symbolic length) planned with its blocks captured
    once gives the plan of the full trace: the same collectives, bytes and checkpointing ladder."""
    fake_world(8)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=64, heads=8, kv_heads=8, layers=32))
    once = _explain(model, 8, 256)
    torch._dynamo.reset()
    each = _explain(model, 8, 256, blocks_once=False)
    assert any(n.startswith("32 blocks LlamaBlock (blocks.0, ...) captured once") for n in once.notes), once.notes
    assert _moved(once) == _moved(each) and once.comm_bytes == each.comm_bytes
    assert str(once.checkpoint) == str(each.checkpoint) and once.memory == each.memory


def _per_rank_signature(gm: fx.GraphModule) -> list[tuple]:
    """Each per-rank node as what it is: op, arguments (nodes by position), shape, module stack,
    forward/backward tag (what the partitioner and the checkpointing pass read), and the first
    node whose fake value shares its storage (a later trace of the graph, Inductor's, reads two
    nodes with one fake value as one tensor)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    at: dict[fx.Node, int] = {}
    storages: dict = {}
    out = []
    for i, nd in enumerate(gm.graph.nodes):
        at[nd] = i
        v = nd.meta.get("val")
        alias = storages.setdefault(StorageWeakRef(v.untyped_storage()), i) if isinstance(v, torch.Tensor) else None

        def token(a):
            return ("node", at[a]) if isinstance(a, fx.Node) else a

        shape = (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v
        stack = tuple((nd.meta.get("nn_module_stack") or {}).values())
        out.append(
            (nd.op, nd.target, repr(fx.map_arg(nd.args, token)), repr(fx.map_arg(nd.kwargs, token)), str(shape))
            + (repr(stack), nd.meta.get("partitioner_tag"), alias)
        )
    return out


@pytest.mark.parametrize("dynamic,L,kv_heads", [(False, 96, 4), (True, 95, 2)], ids=["static", "symbolic-uneven-gqa"])
def test_alike_calls_are_planned_once_and_copied_as_a_full_trace_makes_them(
    fake_world, monkeypatch, dynamic, L, kv_heads
):
    """The example Llama, 4 layers on 4 fake ranks (statically at 96 tokens; a symbolic length at 95,
    which does not divide, with K/V heads fewer than the ranks): the solver plans every alike call
    of the block alike, at the cost of the plan it made call by call (the same objective), and the
    per-rank graph with the calls after the first copied from it (``partition._stamp``) is the one
    tracing every call makes, node for node: ops, arguments, shapes, module stacks and forward or
    backward. Most calls are copies (a call at the ends of the model may read its input otherwise
    and is traced). Would catch a copy reading the template's input instead of its own, a copy
    keeping the template's layer in its module stack or sharing its fake values (Inductor's
    retrace then read two layers' saved activations as one: wrong gradients), or alike layers
    planned apart."""
    from autosp.backend import _backend
    from autosp.partition import _localize
    from autosp.propagate import _solver

    fake_world(4)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=4, kv_heads=kv_heads, layers=4))
    localize, stampers, pairs = _backend.localize, [], []
    Stamper = _localize.Stamper

    def both(graph, choice, inputs, ctx, **kw):
        traced = _per_rank_signature(localize(graph, choice, inputs, ctx, stamp=False, **kw))
        stamped = localize(graph, choice, inputs, ctx, **kw)
        pairs.append((traced, _per_rank_signature(stamped)))
        return stamped

    def recorded(*a, **k):
        stampers.append(Stamper(*a, **k))
        return stampers[-1]

    monkeypatch.setattr(_backend, "localize", both)
    monkeypatch.setattr(_localize, "Stamper", recorded)
    tied = _explain(model, 4, L, dynamic=dynamic)
    monkeypatch.setattr(_solver, "_alike", lambda gm, c: [])
    torch._dynamo.reset()
    apart = _explain(model, 4, L, dynamic=dynamic)
    assert tied.comm_bytes == apart.comm_bytes and tied.memory == apart.memory
    assert _moved(tied) == _moved(apart)
    traced, stamped = pairs[0]  # the tied plan's
    assert len(traced) == len(stamped) and traced == stamped
    # 8 calls (4 forward, 4 backward), the first of each traced
    assert len(stampers[0].calls) == 8 and stampers[0].copied >= 4, stampers[0].copied


def _propagated_both_ways(monkeypatch) -> list:
    """Every propagation of the compiles that follow, run twice: as the backend runs it (an alike
    call's candidates taken from an earlier call's) and visiting every node (no calls found); the
    pairs, and the nodes each visited."""
    from autosp.backend import _backend
    from autosp.propagate import _propagate

    real, visit, pairs = _backend.propagate, _propagate._visit, []

    def both(gm, ctx):
        seen = []
        monkeypatch.setattr(_propagate, "_visit", lambda c, node, *a: seen.append(node) or visit(c, node, *a))
        got, took = real(gm, ctx), len(seen)
        monkeypatch.setattr(_propagate, "calls", lambda graph: [])
        each = real(gm, ctx)
        monkeypatch.undo()  # both patches (and this one's): set again for the next compile
        monkeypatch.setattr(_backend, "propagate", both)
        pairs.append((got, each, took, len(seen) - took))
        return got

    monkeypatch.setattr(_backend, "propagate", both)
    return pairs


def _peer(name: str, *marks):
    import importlib.util

    module = {"torchtitan": "torchtitan", "torchtune": "torchtune", "litgpt": "litgpt", "x": "x_transformers"}
    missing = importlib.util.find_spec(module[name.split("_")[0]]) is None
    skip = pytest.mark.skipif(missing, reason="the peer libraries: pip install -e '.[peers]'")
    return pytest.param(name, marks=[skip, *marks])


@pytest.mark.parametrize(
    "name",
    [
        "example_gqa",
        _peer("torchtitan_deepseek_v3_marked"),
        *(
            _peer(n, pytest.mark.slow)
            for n in ("torchtitan_llama3_flex", "torchtune_gemma2", "x_transformers_shift_tokens")
        ),
    ],
)
def test_an_alike_call_takes_the_candidates_visiting_its_nodes_finds(fake_world, monkeypatch, name):
    """Propagation visits one call of each repeated block and context and gives the others its
    candidates (``propagate._propagate._context``): node for node the strategies, reach, sequence
    placements and unknown ops that visiting every node finds, on models whose blocks differ
    (DeepSeek-V3's dense first layer and MoE layers, marked token-local; Gemma 2's sliding and
    global attention), hold FlexAttention (a rule that reads the graph: always visited), shift
    tokens across ranks (x-transformers), or have K/V heads fewer than the ranks at a length that
    does not divide (the example Llama, 4 ranks, 95 tokens). Symbolic lengths (the default)."""
    fake_world(4)
    torch.manual_seed(0)
    pairs = _propagated_both_ways(monkeypatch)
    if name == "example_gqa":
        _explain(Llama(LlamaConfig(heads=4, kv_heads=2, layers=4)), 4, 95)
    else:
        import peer_models

        model, fn = peer_models.BUILDERS[name]()
        with autosp.mesh(sp=4):
            step = autosp.shard(lambda ids: fn(model, ids), compiler="aot_eager")
            autosp.explain(step, torch.randint(0, peer_models.VOCAB, (1, 64)))
    assert pairs
    for got, each, visits, every in pairs:
        assert got.strategies.keys() == each.strategies.keys()
        assert [nd for nd in got.strategies if got.strategies[nd] != each.strategies[nd]] == []
        assert got.reach == each.reach and got.seq == each.seq
        assert got.no_rule == each.no_rule and got.rows == each.rows
        assert visits <= every
        if name == "example_gqa":  # 4 layers: the 2nd to 4th forward calls taken, in both sweeps
            assert visits < every * 0.6, (visits, every)


def test_the_solvers_program_grows_with_the_distinct_blocks_not_with_the_depth(fake_world, monkeypatch):
    """A later call's nodes take the first call's variables and an edge whose ends choose alike
    takes an earlier edge's flows (``propagate._solver``): the example Llama at 2 and 6 layers (2
    ranks, 64 tokens, symbolic) writes programs whose choices barely grow with the layers and
    whose variables grow by less than 15% of the 2-layer program a layer (measured: 9 choices and
    374 variables a layer, of 691 and 3378; with a variable set per node and edge, 532 and 2515
    of 1214 and 5491). What each layer still adds: the rows tying an all-to-all's one run to
    every op that reads its output, per value."""
    from autosp.propagate import _solver

    fake_world(2)
    sizes, minimise = [], _solver._Program.minimise
    monkeypatch.setattr(
        _solver._Program, "minimise", lambda self, k: sizes.append((len(self.cost), k)) or minimise(self, k)
    )
    for layers in (2, 6):
        torch.manual_seed(0)
        torch._dynamo.reset()
        _explain(Llama(LlamaConfig(heads=4, kv_heads=2, layers=layers)), 2, 64)
    (v2, k2), (v6, k6) = sizes
    assert (k6 - k2) / 4 <= 0.03 * k2, sizes
    assert (v6 - v2) / 4 <= 0.15 * v2, sizes


def test_a_failed_capture_of_alike_blocks_falls_back_to_tracing_each(fake_world, monkeypatch):
    """Should torch's capture of the outlined blocks fail (before autosp's passes run), the step is
    captured again with every block traced, with a warning, and planned as it would have been."""
    from autosp.backend import _backend

    @contextlib.contextmanager
    def failing():
        raise RuntimeError("invoke_subgraph: not supported here")
        yield

    fake_world(2)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=4, kv_heads=4, layers=3))
    each = _explain(model, 2, 64, blocks_once=False)
    torch._dynamo.reset()
    monkeypatch.setattr(_backend, "schema_once", failing)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("autosp").addHandler(handler)
    try:
        fell_back = _explain(model, 2, 64)
    finally:
        logging.getLogger("autosp").removeHandler(handler)
    assert any("capturing alike blocks once failed (RuntimeError" in line for line in lines), lines
    assert not any("captured once" in n for n in fell_back.notes), fell_back.notes
    assert _moved(fell_back) == _moved(each) and str(fell_back.checkpoint) == str(each.checkpoint)


def test_a_users_nested_compile_region_is_planned_as_its_unmarked_model(fake_world):
    """A model whose blocks the user marked with ``torch.compiler.nested_compile_region`` (what
    PyTorch recommends for compiling a repeated block once) plans as the same model unmarked.
    Before, AOTAutograd handed autosp's partitioner the region's own joint graph, with no inputs,
    and the compile failed ("Tracing expected 2 arguments but got 0 concrete arguments")."""
    fake_world(2)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=4, kv_heads=4, layers=3))
    plain = _explain(model, 2, 64)
    torch._dynamo.reset()
    for block in model.blocks:
        block.__class__ = cases.MarkedBlock
    marked = _explain(model, 2, 64)
    assert _moved(marked) == _moved(plain) and str(marked.checkpoint) == str(plain.checkpoint)


@pytest.mark.parametrize("form", ["outlined", "marked"])
def test_blocks_captured_once_run_exact_traced_once_on_two_ranks(pools, form):
    """On 2 gloo ranks, at 64 then 37 tokens (one symbolic compile, uneven shards): the Llama with
    its blocks captured once by autosp, or marked by the user, gives one device's loss and
    gradients (1e-5), with Ulysses' collectives and half the matmul FLOPs per rank; AOTAutograd
    traced the block's joint graph once a compile for its 3 calls."""
    for r in pools(2).run(cases.region_exactness, form, [64, 37]):
        for s in r["steps"]:
            a, b = s["loss"]
            assert abs(a - b) <= 1e-5 * abs(b), s["loss"]
            assert max(s["err"].values()) <= 1e-5, s["err"]
            mine, one = s["flops"]
            assert mine <= 0.55 * one, s["flops"]
        assert r["kinds"] == ["all_reduce", "all_to_all"], r["kinds"]
        # a compile for each (an even and an odd length: the even-shards guard), one trace each
        assert r["block_traces"] == r["graphs"] == 2, (r["block_traces"], r["graphs"])


def _outlined(model: nn.Module, x: torch.Tensor, compare: bool = True):
    """``model(x)`` compiled (symbolic length) with ``outline_blocks`` on Dynamo's graph, then
    AOTAutograd (``aot_eager``), as autosp's backend runs them: the notes, Dynamo's graph as
    rewritten, and the loss, its gradients checked against an eager copy of the model (where
    ``compare``: a model drawing random numbers draws others compiled)."""
    from torch._dynamo.backends.debugging import aot_eager

    from autosp.backend._regions import schema_once

    notes, graphs = [], []

    def backend(gm, example_inputs):
        notes.extend(outline_blocks(gm))
        graphs.append(gm)
        with schema_once():
            return aot_eager(gm, example_inputs)

    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 1)
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    out.backward()
    want = ref(x)
    want.backward()
    if compare:
        torch.testing.assert_close(out, want)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    return tuple(notes), graphs, out


class _Block(nn.Module):
    def __init__(self, dim: int, form: str, scale: float = 1.0):
        super().__init__()
        self.form, self.scale, self.fc, self.norm = form, scale, nn.Linear(dim, dim), nn.LayerNorm(dim)

    def forward(self, x):
        if self.form == "input_in_place":
            x.add_(1.0)
        h = self.fc(self.norm(x))
        if self.form == "in_place":
            h.mul_(0.5)
        elif self.form == "inplace_kwarg":
            h = F.relu(h, inplace=True)
        elif self.form == "setitem":
            h[:, 0] = 0.0
        elif self.form == "dropout":
            h = F.dropout(h, 0.1, training=True)
        elif self.form == "attention_dropout":
            q = h.unflatten(-1, (4, -1)).transpose(1, 2)
            h = F.scaled_dot_product_attention(q, q, q, None, 0.1).transpose(1, 2).flatten(2)  # dropout_p
        elif self.form == "normalize":  # not random (its name holds "normal")
            h = F.normalize(h, dim=-1)
        elif self.form == "no_grad_inside":
            with torch.no_grad():
                h = h * 2.0
        return x + F.gelu(h) * self.scale


class _Mix(nn.Module):
    """x-transformers' other block kind: layers alternate attention-like and feed-forward ones."""

    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.silu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, form="plain", scales=(1.0, 1.0, 1.0), order=(0, 1, 2), mixed=False, call=None):
        super().__init__()
        self.embed = nn.Linear(32, 32)  # every block's input then takes a gradient
        kinds = [_Block(32, form, s) for s in scales]
        self.blocks = nn.ModuleList(k for b in kinds for k in ((b, _Mix(32)) if mixed else (b,)))
        self.order = [j for i in order for j in ((2 * i, 2 * i + 1) if mixed else (i,))]
        self.call = call  # (index, context) a block is called under

    def forward(self, x):
        x = self.embed(x)
        for i in self.order:
            if self.call is not None and self.call[0] == i:
                with self.call[1]():
                    x = self.blocks[i](x)
            else:
                x = self.blocks[i](x)
        return x.float().pow(2).mean()


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return gm.graph.find_nodes(op="call_function", target=invoke_subgraph)


def test_alike_blocks_become_one_subgraph_that_computes_what_they_did():
    """Three alike blocks of Dynamo's graph become three calls of one subgraph (one note), read by
    index, and the step (forward and backward, through AOTAutograd) computes what the model does."""
    torch.manual_seed(0)
    notes, (gm,), _ = _outlined(_Stack(), torch.randn(2, 24, 32))
    assert len(_calls(gm)) == 3 and len({c.args[0].target for c in _calls(gm)}) == 1, gm.graph
    assert all(u.target is operator.getitem for c in _calls(gm) for u in c.users)
    assert notes == (
        "3 blocks _Block (blocks.0, ...) captured once (one subgraph traced for all), then planned as one graph",
    )


def test_two_kinds_of_alternating_blocks_become_two_subgraphs():
    """Layers that alternate two kinds of block (x-transformers' attention and feed-forward layers)
    make two subgraphs, each block's call reading the other kind's call before it. Before, the
    second kind's subgraph was built from inputs the first kind's outlining had replaced
    (``KeyError``)."""
    torch.manual_seed(0)
    notes, (gm,), _ = _outlined(_Stack(mixed=True), torch.randn(2, 24, 32))
    assert len(_calls(gm)) == 6 and len({c.args[1] for c in _calls(gm)}) == 2, gm.graph
    assert sorted(n.split(" (")[0] for n in notes) == ["3 blocks _Block", "3 blocks _Mix"], notes


@pytest.mark.parametrize(
    "kwargs, calls",
    [
        ({"form": "normalize"}, 3),  # F.normalize draws nothing
        # the second of 4 blocks under no_grad: it and the third (its input) take no gradient
        ({"scales": (1.0,) * 4, "order": (0, 1, 2, 3), "call": (1, torch.no_grad)}, 2),
        ({"call": (1, functools.partial(torch.autocast, "cpu", torch.bfloat16))}, 2),  # one block in bf16
    ],
    ids=["normalize", "one_under_no_grad", "one_under_autocast"],
)
def test_blocks_called_otherwise_are_left_out_of_the_alike_ones(kwargs, calls):
    """A block called under another grad mode or autocast computes its values otherwise from alike
    inputs: it is left as traced, the others share one subgraph, and the step's loss and gradients
    are the model's. Before, the first call's subgraph (no gradient, or no cast) would have served
    every call: no gradient for any block, or every block in one precision."""
    torch.manual_seed(0)
    _, (gm,), _ = _outlined(_Stack(**kwargs), torch.randn(2, 24, 32))
    assert len(_calls(gm)) == calls, gm.graph


@pytest.mark.parametrize(
    "form, kwargs",
    [
        ("in_place", {}),  # a block writing to a tensor in place
        ("input_in_place", {}),  # ... to its input
        ("inplace_kwarg", {}),  # ... through an ``inplace=True`` argument
        ("setitem", {}),  # ... or by index
        ("dropout", {}),  # drawing random numbers
        ("attention_dropout", {}),  # ... in attention
        ("no_grad_inside", {}),  # setting the grad mode
        ("plain", {"scales": (1.0, 0.5, 0.25)}),  # not alike: each its own constant
        ("plain", {"order": (0, 1, 0)}),  # a block called twice: its ops not contiguous
    ],
    ids=[
        "in_place",
        "input_in_place",
        "inplace_kwarg",
        "setitem",
        "dropout",
        "attention_dropout",
        "no_grad_inside",
        "unlike_constants",
        "called_twice",
    ],
)
def test_blocks_that_cannot_share_one_subgraph_are_left_as_traced(form, kwargs):
    """A block is outlined only where one subgraph for all is sound: none of these is (and the
    step is the model's)."""
    torch.manual_seed(0)
    notes, (gm,), _ = _outlined(_Stack(form, **kwargs), torch.randn(2, 24, 32), compare="dropout" not in form)
    assert notes == () and not _calls(gm)
