"""Fallback rule source: DTensor's registered op strategies, for ops autosp has no rule of its own:
its op strategies and (torch 2.13 registers most ops so: 1013 against 158) its single-mesh-dim
strategies, whose placeholders are filled with the shards the inputs can take.

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
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
from torch.utils._pytree import tree_map

from .._graph import hint, out_vals, tensor_inputs
from ._placement import R, exact, is_even, shard, shard_spec
from ._strategy import Strategy, dedup

__all__ = ["DISPATCH_OPS", "dtensor_strategies"]

# Ops that move tokens by data-dependent indices (an MoE layer's dispatch, HF's mask bookkeeping
# ``padding_mask[batch_idx, kv_idx]``). autosp gives them no rule on purpose, and DTensor's
# single-dim strategies are not read for them: such an op runs replicated, on index and mask data
# computed whole from replicated inputs for free, and one that would read sharded activations is
# refused (``_solver._check_no_rule`` suggests ``autosp.token_local``). DTensor's strategies for
# them (the indexed tensor split along its other dims, the indices split) gave plans that gather
# the bool mask afterwards, or carry a dispatch split along the hidden dim into a custom op.
DISPATCH_OPS = {
    torch.ops.aten.index_add.default,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_select.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.bincount.default,
    torch.ops.aten.histc.default,
}


def dtensor_strategies(node: fx.Node, A, n: int, mesh) -> list[Strategy] | None:
    op = node.target
    prop = DTensor._op_dispatcher.sharding_propagator
    if not isinstance(op, torch._ops.OpOverload) or mesh is None:
        return None
    if op in prop.op_single_dim_strategy_funcs and op not in prop.op_strategy_funcs:
        if op in DISPATCH_OPS:
            return None
        return _single_dim_strategies(node, A, n, prop.op_single_dim_strategy_funcs[op])
    fn = prop.op_strategy_funcs.get(op)
    if fn is None:
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


def _single_dim_strategies(node: fx.Node, A, n: int, info) -> list[Strategy] | None:
    """DTensor's single-mesh-dim strategy of ``node``'s op: rows of (outputs..., inputs...)
    placements, a ``_ShardingPlaceholder(d)`` standing for a shard of dim d in whatever kind the
    inputs hold (autosp's: plain or strided); replication always. An op DTensor runs on even
    shards only (``allow_uneven_sharding``) keeps its shards where every sharded dim divides."""
    inputs = tensor_inputs(node)

    def to_meta(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return TensorMeta(v.shape, v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v
        return a

    try:
        rows = info.func(node.target, tree_map(to_meta, node.args), tree_map(to_meta, node.kwargs))
    except Exception:  # DTensor's strategy rejected this call: treat as "no rule"
        return None
    outs = out_vals(node)
    vals = outs + [out_vals(u)[i] for u, i in inputs]
    factors = sorted({shard_spec(p)[1] for a in A for p in a if shard_spec(p) is not None}) or [1]
    strats = [Strategy(tuple(None if v is None else R for v in outs), tuple(R for _ in inputs))]
    for row in rows:
        if len(row) != len(vals):
            continue
        for sf in factors if any(isinstance(p, _ShardingPlaceholder) for p in row) else [1]:
            ps = [shard(p.dim, sf) if isinstance(p, _ShardingPlaceholder) else p for p in row]
            if not all(exact(p, as_input=i >= len(outs)) for i, p in enumerate(ps)):
                continue
            if not info.allow_uneven_sharding and not all(
                shard_spec(p) is None or is_even(hint(v.shape[shard_spec(p)[0]]), sf, n)
                for p, v in zip(ps, vals)
                if v is not None and p is not None
            ):
                continue
            strats.append(Strategy(tuple(ps[: len(outs)]), tuple(ps[len(outs) :])))
    return dedup(strats)
