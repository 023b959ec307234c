"""Fallback rule source: DTensor's registered op strategies, for ops autosp has no rule of its own.

A strategy is taken only where every placement in it is one autosp runs exactly
(``_placement.exact``): DTensor's strategies also produce partial products, averages and masked
partials, and accept partial maxima and norms as inputs, which autosp's redistribute does not
honour; such strategies are dropped here, and the op runs on the placements that remain (or, with
none, as an op without a rule)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.utils._pytree import tree_map

from .._graph import out_vals, tensor_inputs
from ._placement import exact
from ._strategy import Strategy

__all__ = ["dtensor_strategies"]


def dtensor_strategies(node: fx.Node, A, n: int, mesh) -> list[Strategy] | None:
    op = node.target
    prop = DTensor._op_dispatcher.sharding_propagator
    fn = prop.op_strategy_funcs.get(op) if isinstance(op, torch._ops.OpOverload) else None
    if fn is None or mesh is None:
        return None
    inputs = tensor_inputs(node)
    it = iter(range(len(inputs)))

    def to_strategy(a):
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            j = next(it)
            v = a.meta["val"]
            meta = TensorMeta(v.shape, v.stride(), v.dtype)
            return OpStrategy([OpSpec(DTensorSpec(mesh, (p,), meta)) for p in sorted(A[j], key=str)])
        if isinstance(a, fx.Node):
            return a.meta.get("val")
        return a

    args = tree_map(to_strategy, node.args)
    kwargs = tree_map(to_strategy, node.kwargs)
    try:
        result = fn(OpSchema(op, args, kwargs))
    except Exception:  # DTensor's strategy rejected this call: treat as "no rule"
        return None
    specs = result.strategies if isinstance(result, OpStrategy) else None
    if isinstance(result, TupleStrategy):
        return None
    nouts = len(out_vals(node))
    strats = []
    for s in specs or []:
        outs = s.output_specs if isinstance(s.output_specs, tuple) else (s.output_specs,)
        outs = tuple(o.placements[0] if o is not None else None for o in outs)
        if len(outs) != nouts or s.input_specs is None or len(s.input_specs) != len(inputs):
            continue
        ins = tuple(i.placements[0] for i in s.input_specs)
        if all(exact(p) for p in outs) and all(exact(q, as_input=True) for q in ins):
            strats.append(Strategy(outs, ins))
    return strats or None
