"""The per-rank joint graph: run the global joint graph on local shards, following the plan,
with a collective on every edge whose producer placement differs from what the consumer needs,
and trace that into an ATen graph (make_fx) that AOTAutograd's partitioner then splits."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map

from ..errors import PlanError
from ..propagate._placement import R, local_shape
from ..propagate._rules import out_vals, tensor_inputs
from ..propagate._solver import Choice
from ._collectives import redistribute

__all__ = ["localize"]

aten = torch.ops.aten

# ops whose argument 1 is the output's shape: the local graph needs the local shape there
_SHAPE_ARG = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
              aten.slice_backward.default, aten.select_backward.default}


def localize(joint: fx.GraphModule, choice: Choice, joint_inputs, n: int, rank: int, group) -> fx.GraphModule:
    graph = joint.graph
    placeholders = [nd for nd in graph.nodes if nd.op == "placeholder"]
    plan = choice.strategy

    def run(primals, tangents):
        env: dict[fx.Node, object] = dict(zip(placeholders, list(primals) + list(tangents)))

        def value(u: fx.Node, i: int):
            v = env[u]
            return v[i] if u.target is not operator.getitem and isinstance(v, (tuple, list)) else v

        for nd in graph.nodes:
            if nd.op == "get_attr":
                env[nd] = getattr(joint, nd.target)
            elif nd.op == "call_function":
                s = plan[nd]
                ins = tensor_inputs(nd)
                local = [redistribute(value(u, i), plan[u].outs[i], q, n, rank, group)
                         for (u, i), q in zip(ins, s.ins)]
                if nd.target is operator.getitem or nd.target is torch.ops.autosp.annotate.default:
                    env[nd] = local[0]
                    continue
                it = iter(local)

                def sub(a):
                    if isinstance(a, fx.Node):
                        return next(it) if isinstance(a.meta.get("val"), torch.Tensor) else env[a]
                    return a

                args = tree_map(sub, nd.args)
                kwargs = tree_map(sub, nd.kwargs)
                if nd.target in _SHAPE_ARG:
                    args = (args[0], local_shape(out_vals(nd)[0].shape, s.outs[0], n)) + tuple(args[2:])
                target = nd.target
                if target in (aten.view.default, aten._unsafe_view.default):
                    # the global graph's strides allowed a view; a collective's output may not
                    target = aten.reshape.default
                try:
                    env[nd] = target(*args, **kwargs)
                except Exception as e:
                    shapes = [tuple(t.shape) for t in local]
                    raise PlanError(nd, f"the per-rank op failed ({type(e).__name__}: {e}) with local input shapes "
                                    f"{shapes}, input placements {[str(q) for q in s.ins]}, output {[str(o) for o in s.outs]}",
                                    "this is an autosp bug in the op's sharding rule; please report it with this message") from e
            elif nd.op == "output":
                def out(a):
                    if isinstance(a, fx.Node):
                        return redistribute(env[a], plan[a].outs[0], R, n, rank, group)
                    return a
                return tree_map(out, nd.args[0])

    primals, tangents = joint_inputs
    return make_fx(run)(primals, tangents)
