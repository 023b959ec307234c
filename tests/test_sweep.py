"""Plan tier (a fake process group): every elementwise and factory-like op DTensor has a strategy
for keeps a sequence shard, and so do the views that leave the sequence dim alone.

x-transformers' attention-on-attention and value residual were refused for want of a rule for
``aten.fill.Scalar`` (``torch.empty_like(x).fill_(v)``, functionalized), and autosp read only
DTensor's op strategies, not its single-mesh-dim ones (torch 2.13 registers 1013 ops that way
against 158): an op registered only there had no rule at all. The sweep synthesizes a call of
each registered op on a (2, 8, 4) tensor sharded along dim 1, and asks for a strategy that keeps
every input and the output sharded along it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor._ops
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autosp._graph import tensor_inputs
from autosp.propagate._rules import strategies_for

aten = torch.ops.aten
S1, R = Shard(1), Replicate()
# position-dependent along the matrix dims (a triangle of the last two dims, one of them the
# sequence here): a row's result depends on its global index, not elementwise
NOT_ELEMENTWISE = {"aten.tril.default", "aten.triu.default"}


def _call(op, x):
    """``op`` on ``x`` with its other required arguments made up, or None where one cannot be."""
    args = []
    for a in op._schema.arguments:
        t = str(a.type)
        if a.kwarg_only or (a.has_default_value() and t != "Tensor"):
            break
        if t == "Tensor":
            args.append(torch.tensor(0.5) if a.name == "value" else x.clone())
        elif t in ("Scalar", "number"):
            args.append(0.5)
        else:
            return None
    return args


def _elementwise_calls():
    prop = DTensor._op_dispatcher.sharding_propagator
    ops = {*prop.op_strategy_funcs, *prop.op_single_dim_strategy_funcs, aten.fill.Scalar, aten.zero.default}
    found = []
    for op in sorted(ops, key=str):
        schema = op._schema
        if schema.is_mutable or any(r.alias_info for r in schema.returns) or "out" in op._overloadname:
            continue
        x = torch.randn(2, 8, 4)
        args = _call(op, x)
        if args is None:
            continue
        try:
            y = op(*args)
        except Exception:  # the made-up arguments do not fit this op
            continue
        if not (isinstance(y, torch.Tensor) and y.shape == x.shape) or str(op) in NOT_ELEMENTWISE:
            continue
        nd = next((nd for nd in _traced(op, args) if nd.target is op), None)
        if nd is not None:  # else decomposed on the way: autosp never sees it
            found.append((op, nd))
    return found


def _traced(op, args) -> list:
    """The call's nodes, traced (the made-up scalars closed over)."""
    ti = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def call(*ts):
        full = list(args)
        for i, t in zip(ti, ts):
            full[i] = t
        return op(*full)

    return _node(call, *[args[i] for i in ti])


def _node(fn, *tensors):
    gm = make_fx(fn, tracing_mode="fake")(*tensors)
    return [nd for nd in gm.graph.nodes if nd.op == "call_function"]


CALLS = _elementwise_calls()


@pytest.fixture
def mesh(fake_world):
    fake_world(2)
    return init_device_mesh("cpu", (2,))


def _keeps_shard(nd, mesh, out=S1, ins=None) -> bool:
    inputs = tensor_inputs(nd)
    A = [frozenset({R, S1}) for _ in inputs]
    scalar = [u.meta["val"].ndim == 0 for u, _ in inputs]
    want = ins or [R if s else S1 for s in scalar]
    return any(s.outs[0] == out and list(s.ins) == want for s in strategies_for(nd, A, 2, mesh) or [])


def test_the_sweep_covers_the_registered_elementwise_ops():
    """The sweep is not vacuous: over 150 of DTensor's registered ops are called, fill and zero among them."""
    names = {str(op) for op, _ in CALLS}
    assert len(names) > 150 and {"aten.fill.Scalar", "aten.zero.default", "aten.add.Tensor"} <= names, len(names)


@pytest.mark.parametrize("op,nd", CALLS, ids=[str(op) for op, _ in CALLS])
def test_an_elementwise_op_keeps_the_sequence_shard(mesh, op, nd):
    A = [frozenset({R, S1})] * len(tensor_inputs(nd))
    assert _keeps_shard(nd, mesh), [str(s) for s in strategies_for(nd, A, 2, mesh) or []]


VIEWS = {
    "unsqueeze(0)": (lambda x: x.unsqueeze(0), Shard(2)),
    "transpose(0, 2)": (lambda x: x.transpose(0, 2), S1),
    "permute(2, 1, 0)": (lambda x: x.permute(2, 1, 0), S1),
    "view(2, 8, 2, 2)": (lambda x: x.view(2, 8, 2, 2), S1),
    "reshape(2, 8, 2, 2)": (lambda x: x.reshape(2, 8, 2, 2), S1),
    "unflatten(2, (2, 2))": (lambda x: x.unflatten(2, (2, 2)), S1),
    "expand(2, 2, 8, 4) of unsqueeze(1)": (lambda x: x[:, None].expand(2, 2, 8, 4), Shard(2)),
    "narrow(2, 1, 2)": (lambda x: x.narrow(2, 1, 2), S1),
    "x[..., :2]": (lambda x: x[..., :2], S1),
    "select(2, 0)": (lambda x: x.select(2, 0), S1),
    "movedim(1, 0)": (lambda x: x.movedim(1, 0), Shard(0)),
    "split(2, dim=2)[1]": (lambda x: x.split(2, dim=2)[1], S1),
    "chunk(2, dim=-1)[0]": (lambda x: x.chunk(2, dim=-1)[0], S1),
}


@pytest.mark.parametrize("form", list(VIEWS))
def test_a_view_that_leaves_the_sequence_alone_keeps_it_sharded(mesh, form):
    """Each op of the view, in order, keeps the shard where the sequence dim went."""
    fn, out = VIEWS[form]
    nodes = _node(fn, torch.randn(2, 8, 4))
    placed = {}
    for nd in nodes:
        src = nd.args[0]
        p = placed.get(src, S1)
        A = [frozenset({R, p})] + [frozenset({R}) for _ in tensor_inputs(nd)[1:]]
        kept = [s for s in strategies_for(nd, A, 2, mesh) or [] if s.ins[0] == p and s.outs[0] not in (R, None)]
        assert kept, (form, nd.format_node(), [str(s) for s in strategies_for(nd, A, 2, mesh) or []])
        placed[nd] = kept[0].outs[0]
    assert placed[nodes[-1]] == out, (form, placed)
