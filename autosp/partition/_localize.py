"""The per-rank joint graph: the global joint graph run on local shards, following the plan, with
a collective on every edge whose producer placement differs from what the consumer needs, traced
into an ATen graph (make_fx) that AOTAutograd's partitioner then splits.

``Localizer`` is the interpreter: each node's inputs are redistributed to the placements its
strategy requires, then the op runs on them. A few ops run otherwise per rank: ``OVERRIDES``,
keyed by op (dropout draws its own shard's mask; FSDP2's gradient reduce counts a replicated
gradient once; a sharded factory makes its local shape), and ``KERNELS``, keyed by the
strategy's kernel (attention on this rank's query rows; a shift along the sequence as a halo
exchange, ``_shift``; a log-sum-exp merged over the ranks, ``_merge``; a scatter into this
rank's own rows, ``_scatter``). FlexAttention runs its own call under every strategy
(``_flex.FLEX_CALLS``: its functions and block mask rewritten for this rank's piece).
``localize`` composes, in one trace, the interpreter, the tiling of its ops along the sequence
when one is given (``_tiling``), and the outputs placed as one device returns them
(``_outputs``: gradients summed over sp, averaged over dp).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from torch._prims_common import is_contiguous_or_false
from torch.fx.experimental import _config as fx_config
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_map

from .._attention_ops import ATTENTION, call_grouped, padded_lse
from .._context import SpContext
from .._graph import out_vals, retraced, tensor_inputs
from ..errors import PlanError
from ..propagate._annotate import ANNOTATE
from ..propagate._placement import local_shape, redistribute_kind, shard_spec
from ..propagate._rules import FILLED_FACTORIES
from ..propagate._solver import Choice
from ..propagate._strategy import Strategy
from ._attention import SEQUENCE_KERNELS
from ._collectives import redistribute
from ._flex import FLEX_CALLS
from ._fsdp import REDUCE, fsdp_reduce_call
from ._merge import MERGE_KERNELS
from ._outputs import output_specs, place_outputs
from ._random import dropout_call
from ._scatter import OWN_ROWS_KERNELS
from ._shift import HALO_KERNELS
from ._stamp import Lazy, Stamper
from ._tiling import SHAPE_ARG, TileRunner, Tiling

__all__ = ["Localizer", "localize", "OVERRIDES"]

aten = torch.ops.aten


def _factory_call(nd, s, target, args, kwargs, ctx):
    """A tensor of one value placed as a shard: made in this rank's shape."""
    if shard_spec(s.outs[0]) is None:
        return target, args, kwargs
    j = FILLED_FACTORIES[target]
    with disable_proxy_modes_tracing():
        shape = local_shape(out_vals(nd)[0].shape, s.outs[0], ctx.n, ctx.rank)
    return target, (*args[:j], [retraced(x) for x in shape], *args[j + 1 :]), kwargs


def _pad_call(nd, s, target, args, kwargs, ctx):
    """A pad of symbolic size on an input not known contiguous, made contiguous after (a copy).
    Where no pad is positive (a chunk pad's backward: ``[0, 0, -p, 0]``), eager torch returns
    the input narrowed and copied in its own layout, but the trace's meta on a symbolic pad
    (torch's reference) a contiguous tensor: the per-rank graph's later views read the trace's
    strides, and failed at run time ("view size is not compatible", Falcon-H1's backward)."""
    x, pad = args[0], args[1]
    if not any(isinstance(p, torch.SymInt) for p in pad) or is_contiguous_or_false(x):
        return target, args, kwargs

    def pad_contiguous(*a, **k):
        return aten.clone.default(target(*a, **k), memory_format=torch.contiguous_format)

    return pad_contiguous, args, kwargs


def _grouped_call(nd, s, target, args, kwargs, ctx):
    """An attention op of a kernel that takes no grouped K/V, on this rank's heads or sequences:
    its K/V repeated just before it (``_attention_ops.call_grouped``; folded K/V repeats)."""
    return functools.partial(call_grouped, target), args, kwargs


# op -> its per-rank call: (node, strategy, target, args, kwargs, ctx) -> (target, args, kwargs)
OVERRIDES = {
    **{op: _grouped_call for k in ATTENTION.values() if not k.gqa for op in (k.forward, k.backward)},
    aten.native_dropout.default: dropout_call,
    REDUCE: fsdp_reduce_call,
    aten.constant_pad_nd.default: _pad_call,
    **dict.fromkeys(FILLED_FACTORIES, _factory_call),
}
# strategy kernel -> its per-rank call
KERNELS = {**SEQUENCE_KERNELS, **HALO_KERNELS, **MERGE_KERNELS, **OWN_ROWS_KERNELS}
_PASS_THROUGH = (operator.getitem, ANNOTATE)  # their (redistributed) input is their value
# the global graph's strides allowed a view; a collective's output may not
_VIEWS = (aten.view.default, aten._unsafe_view.default)
_DEFERRED = object()  # a tiled op's value before its tiles ran


class Localizer(fx.Interpreter):
    """Runs the global joint graph on this rank's shards (see the module docstring); with a
    ``tiling``, its ops run tile by tile (``_tiling.TileRunner``)."""

    def __init__(
        self,
        joint: fx.GraphModule,
        plan: dict[fx.Node, Strategy],
        ctx: SpContext,
        tiling: Tiling | None = None,
        stamp: bool = True,
    ):
        super().__init__(joint, garbage_collect_values=False)
        self.extra_traceback = False  # autosp's errors say where they come from
        self.plan, self.ctx = plan, ctx
        self.moved: dict[tuple, torch.Tensor] = {}  # (node, output, placement) -> its all-to-all
        self.tiles = TileRunner(self, tiling) if tiling is not None else None
        # repeated blocks' per-rank nodes copied from their first call's (untiled graphs)
        self.stamps = Stamper(self, joint.graph) if stamp and tiling is None else None

    def run_node(self, nd: fx.Node):
        stamps = self.stamps
        if stamps is None:
            return self._run_node(nd)
        if stamps.run(nd):  # a copied call's node
            return self.env[nd]
        if stamps.recording is None:
            return self._run_node(nd)
        before = stamps.last()
        value = self._run_node(nd)
        stamps.ran(nd, before, value)
        return value

    def _run_node(self, nd: fx.Node):
        if self.tiles is not None and self.tiles.defers(nd):
            return _DEFERRED
        # the per-rank nodes keep their global node's meta (module stack, forward/backward tag):
        # the checkpointing pass reads it
        with fx.traceback.set_current_meta(nd):
            if nd.op == "call_function" and nd not in self.plan:
                # a size: the global one (symbolic), but a count a data-dependent op made (nonzero's)
                # is this rank's own tensor's, replicated, and its symbol this trace's
                if free_unbacked_symbols(nd.meta.get("val")):
                    return super().run_node(nd)
                return retraced(nd.meta["val"])
            if nd.op == "call_function":
                return self.call(
                    nd, [self.redistributed(u, i, q) for (u, i), q in zip(tensor_inputs(nd), self.plan[nd].ins)]
                )
            if nd.op == "output":  # the outputs as planned; ``_outputs`` places them
                return tree_map(lambda a: self.value(a, 0) if isinstance(a, fx.Node) else a, nd.args[0])
            return super().run_node(nd)

    def value(self, u: fx.Node, i: int):
        """Output i of node u on this rank, as planned."""
        v = self.env[u]
        if isinstance(v, Lazy):  # a copied call's value (``_stamp``)
            v = self.env[u] = self.stamps.value(v)
        if v is _DEFERRED:  # a tiled op read untiled
            with fx.traceback.set_current_meta(u):
                v = self.env[u] = self.tiles.joined(u)
        return v[i] if u.target is not operator.getitem and isinstance(v, (tuple, list)) else v

    def redistributed(self, u: fx.Node, i: int, q) -> torch.Tensor:
        """Output i of node u on this rank, placed as ``q``. An all-to-all runs once for all the
        ops that read the value so (the attention backward reads the K/V its forward read, in
        the same heads layout); its output is shard-sized, so keeping it costs what keeping its
        input would. Other collectives run per consumer: a gathered or reduced activation kept
        from the forward for the backward would be whole."""
        ctx, p = self.ctx, self.plan[u].outs[i]
        key = (u, i, q)
        if key in self.moved:
            if isinstance(self.moved[key], Lazy):
                self.moved[key] = self.stamps.value(self.moved[key])
            return self.moved[key]
        op = padded_lse(u, i)
        if op is not None and p != q:  # the solver never plans it (``_solver._add_edge``)
            raise PlanError(
                u,
                f"the {op.name} kernel's log-sum-exp, its rows padded to a multiple of {op.lse_rows}, would move "
                f"from {p} to {q} between its forward and backward: padded rows do not split as the sequence does",
                "this is an autosp bug (the solver never plans it); please report it with this message",
            )
        shape = [retraced(x) for x in out_vals(u)[i].shape]
        y = redistribute(self.value(u, i), p, q, ctx.n, ctx.rank, ctx.group, shape)
        if redistribute_kind(p, q) == "all_to_all":
            self.moved[key] = y
        return y

    def call(self, nd: fx.Node, local: list, tile: tuple[int, int] | None = None):
        """The op on per-rank inputs ``local``; ``tile``: (dim, rows) of a tile, for the ops that
        take their output's shape as an argument."""
        if nd.target in _PASS_THROUGH:
            return local[0]
        s = self.plan[nd]
        args, kwargs = self._arguments(nd, local)
        # a replicated shape with a data-dependent count is the one in the arguments (this trace's)
        if nd.target in SHAPE_ARG and not (shard_spec(s.outs[0]) is None and free_unbacked_symbols(nd.meta["val"])):
            with disable_proxy_modes_tracing():  # sizes of the global graph: see retraced
                shape = local_shape(out_vals(nd)[0].shape, s.outs[0], self.ctx.n, self.ctx.rank)
            if tile is not None:
                shape[tile[0]] = tile[1]
            args = (args[0], [retraced(x) for x in shape], *args[2:])
        target = nd.target
        override = FLEX_CALLS.get(target) or KERNELS.get(s.kernel) or OVERRIDES.get(target)
        if override is not None:
            target, args, kwargs = override(nd, s, target, args, kwargs, self.ctx)
        if target in _VIEWS:
            target = aten.reshape.default
        try:
            return target(*args, **kwargs)
        except Exception as e:
            shapes = [tuple(t.shape) for t in local]
            raise PlanError(
                nd,
                f"the per-rank op failed ({type(e).__name__}: {e}) with local input shapes "
                f"{shapes}, input placements {[str(q) for q in s.ins]}, output {[str(o) for o in s.outs]}",
                "this is an autosp bug in the op's sharding rule; please report it with this message",
            ) from e

    def _arguments(self, nd: fx.Node, local: list):
        """The node's arguments with its tensor inputs replaced by ``local`` (in order)."""
        it = iter(local)

        def sub(a):
            if isinstance(a, fx.Node):
                if isinstance(a.meta.get("val"), torch.Tensor):
                    return next(it)
                v = self.env[a]
                return self.stamps.value(v) if isinstance(v, Lazy) else v
            return a

        return tree_map(sub, nd.args), tree_map(sub, nd.kwargs)


def localize(
    joint: fx.GraphModule,
    choice: Choice,
    joint_inputs,
    ctx: SpContext,
    *,
    num_fwd_outputs: int,
    tiling: Tiling | None = None,
    stamp: bool = True,
) -> fx.GraphModule:
    """The per-rank joint graph of ``joint`` under the plan ``choice``: its ops on this rank's
    shards (tiled along the sequence with ``tiling``), its outputs as one device's. With
    ``stamp``, a repeated block's call that runs as its first is a copy of its per-rank nodes
    (``_stamp``), not traced again."""
    plan = choice.strategy
    outputs = output_specs(joint, plan, num_fwd_outputs)

    # the arguments' names make the placeholders' (primals_*, tangents_*): the partitioner reads them
    def run(primals, tangents):
        # flat inputs and outputs, as the partitioner sees the joint graph (not its pytree codegen's)
        values = Localizer(joint, plan, ctx, tiling, stamp).run(*primals, *tangents, enable_io_processing=False)
        return place_outputs(values, outputs, ctx)

    # size-oblivious on the lengths: torch's contiguity and size-1 checks on a rank's piece of a
    # symbolic length (a chunk pad's rows) would guard the compile to this length's local sizes
    with fx.traceback.preserve_node_meta(), fx_config.patch(backed_size_oblivious=True):
        return make_fx(run)(*joint_inputs)
