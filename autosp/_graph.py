"""Graph helpers every stage uses: a node's outputs and tensor inputs, its arguments by name, its
bytes, which ops are attention, and sizes at their hints or as values of a trace in progress. A
leaf: it imports nothing from autosp but the attention kernels' table (``_attention_ops``)."""

from __future__ import annotations

import math
import operator
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true
from torch.fx.operator_schemas import normalize_function
from torch.utils._sympy.functions import CeilToInt, FloorDiv, FloorToInt, IntTrueDiv
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis

from ._attention_ops import ATTENTION, CPU_FLASH

__all__ = [
    "hint",
    "retraced",
    "known_alike",
    "fixed",
    "SYM_TYPES",
    "out_vals",
    "tensor_inputs",
    "op_args",
    "nbytes",
    "out_bytes",
    "is_attention",
    "is_attention_backward",
    "graph_module",
    "ATTENTION_OPS",
    "SDPA_CPU",
    "SDPA_CPU_BACKWARD",
]

aten = torch.ops.aten

SDPA_CPU = CPU_FLASH.forward
SDPA_CPU_BACKWARD = CPU_FLASH.backward
# attention op -> whether it is a backward: the kernels of ``_attention_ops.ATTENTION``; autosp's
# ring attention ops (``partition._attention``) register themselves here where they are defined
ATTENTION_OPS: dict[Any, bool] = {op: op is k.backward for op, k in ATTENTION.items()}


def graph_module(root, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose Python code is generated when first needed (torch's
    ``_LazyGraphModule``, which Dynamo's compiles use), not at once and at every ``recompile``: the
    planner's copies (a rung's tagged graph, each one the partitioner makes from it) are read, never
    run, but for the one compiled. Generating a 32-layer joint graph's code took 7.4 of 63 s of a
    profiled compile (``benchmarks/compile_time.py``, 32 layers, sp 8)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def is_attention(target) -> bool:
    """Whether ``target`` is an attention kernel (forward or backward)."""
    return target in ATTENTION_OPS


def is_attention_backward(target) -> bool:
    return ATTENTION_OPS.get(target, False)


SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def hint(x):
    """A size, count or cost (or a sequence of them) at its hint, without a guard: a symbolic
    sequence length read at the length the compile was first called with. Cost models and
    planning read sizes so; the per-rank graph keeps them symbolic. Plain numbers pass through."""
    if isinstance(x, (list, tuple)):  # a torch.Size becomes a tuple
        return [hint(a) for a in x] if isinstance(x, list) else tuple(hint(a) for a in x)
    if isinstance(x, torch.SymInt):
        return optimization_hint(x)
    if isinstance(x, (torch.SymFloat, torch.SymBool)):
        node = x.node
        if node.hint is not None:
            return node.hint
        value = node.shape_env.size_hint(node.expr, allow_none=True)
        if value is None:  # a data-dependent count (nonzero's) in it: torch's fallback for it
            value = node.shape_env.optimization_hint(node.expr)
        return node.pytype(value)
    return x


def retraced(x):
    """A size of the global graph as a value of the trace in progress (``make_fx`` of the per-rank
    graph): an expression of a length the global trace made (a padding to a multiple of a
    chunk, ``(-s) % 16`` or ``16 * math.ceil(s / 16) - s``) built again from the symbols this
    trace tracks, which make_fx cannot always do itself (it raised "PythonMod(-s50, 16) is not
    tracked with proxy"). A rounded true division of integers is rebuilt as a floor division
    (exact; the float one cannot be evaluated on symbols). A float of the length too (a variance's
    gradient scales by ``2 / (S - 1)``: "FloatTrueDiv(2.0, ToFloat(s50) - 1.0) is not tracked
    with proxy" under Inductor's symbolic lengths). Anything else passes through."""
    mode = get_proxy_mode()
    if mode is None or not isinstance(x, (torch.SymInt, torch.SymFloat)) or not x.node.is_symbolic():
        return x
    x = fixed(x)
    if isinstance(x, int):
        return x
    known = mode.tracer.sympy_expr_tracker
    expr = x.node.expr
    if expr in known or not all(sym in known for sym in expr.free_symbols):
        return x
    expr = expr.replace(_rounded_division, _as_floor_division)
    return sympy_interp(PythonReferenceAnalysis, {sym: known[sym].value for sym in expr.free_symbols}, expr)


# shape env -> {condition: whether it was statically known}, for ``known_alike``
_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def known_alike(cond) -> bool:
    """``statically_known_true(cond)``, answered once per compile (shape env) and condition: a
    choice that shapes the collectives (which pieces a halo exchange moves) must be the same in
    every rank's trace. Statically known reads what the shape env has learnt so far, which grows
    as each per-rank trace adds its guards: asked in the trace of another rank, or later in the
    same one, the same condition was answered otherwise, and the ranks' graphs then issued
    different collectives (Falcon-H1's causal convolution at 61 tokens on 2 ranks). Every process
    traces the ranks in the same order, so the first answer, kept, is the same on every rank."""
    if not isinstance(cond, torch.SymBool):
        return bool(cond)
    answers = _KNOWN.setdefault(cond.node.shape_env, {})
    key = cond.node.expr
    if key not in answers:
        answers[key] = statically_known_true(cond)
    return answers[key]


def fixed(x):
    """``x`` as a plain int where the compile's guards, as first asked, fix its value: a size the trace
    writes as an expression of the length but that is one number at every length the graph runs
    at. A pad to a multiple of a chunk of 16 then ``view(b, -1, 16, d)`` of a length up to 16 is
    one chunk, guarded, and torch's view writes the chunk as ``X // (X // 16)`` (X the padded
    length), which nothing simplifies: sharded, its rows were symbolic, and a flip's exchange of
    them stopped the per-rank trace. Answered once per compile (``known_alike``)."""
    if isinstance(x, torch.SymInt) and x.node.is_symbolic():
        value = hint(x)
        with disable_proxy_modes_tracing():  # a question of the shape env, not an op of the trace
            known = known_alike(x == value)
        if known:
            return value
    return x


def _rounded_division(e) -> bool:
    """``math.ceil(a / b)`` or ``math.floor(a / b)`` of integers, as the trace records them."""
    return isinstance(e, (CeilToInt, FloorToInt)) and isinstance(e.args[0], IntTrueDiv)


def _as_floor_division(e):
    """ceil(a / b) = -((-a) // b) and floor(a / b) = a // b, exactly, on integers."""
    a, b = e.args[0].args
    return -FloorDiv(-a, b) if isinstance(e, CeilToInt) else FloorDiv(a, b)


def out_vals(node: fx.Node) -> list:
    """The node's outputs as a flat list of fake tensors (None where an output is not a tensor)."""
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    return [v if isinstance(v, torch.Tensor) else None for v in vals]


def tensor_inputs(node: fx.Node) -> list[tuple[fx.Node, int]]:
    """Each tensor-valued input occurrence as (producer, output index), in argument order."""
    if node.target is operator.getitem:
        return [(node.args[0], node.args[1])]
    read: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), read.append)  # in argument order (torch's C++ walk: 27x a pytree's)
    return [(a, 0) for a in read if isinstance(a.meta.get("val"), torch.Tensor)]


def op_args(node: fx.Node) -> dict[str, Any]:
    """Every argument of an op node by its schema name, defaults filled in."""
    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs


def nbytes(t: torch.Tensor) -> int:
    """A tensor's bytes as laid out densely (what a collective moves)."""
    return hint(math.prod(t.shape)) * t.element_size()


def out_bytes(node: fx.Node) -> int:
    """The bytes of all of a node's tensor outputs."""
    return sum(nbytes(v) for v in out_vals(node) if v is not None)
