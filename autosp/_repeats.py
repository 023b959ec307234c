"""Repeated blocks' calls in the flat graph the backend plans: each node inlined from a call of a
block captured once (``backend._regions.inline_regions``) is tagged with its call (``REGION``), and
``calls`` finds each call's nodes, the values they read from outside, and what makes two calls'
nodes the same ops on the same shapes (``Call.signature``). The solver plans alike calls alike
(``propagate._solver``) and localizing copies a traced call's per-rank nodes for the others
(``partition._stamp``)."""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

__all__ = ["REGION", "Call", "calls", "block_of", "repeated_blocks"]

# a module reached by indexing a container: "model.layers.3", "L['self'].model.layers[3]",
# "getattr(L['fsdp'].tops[0].blocks, '3')" (how Dynamo names it under a swapped-parameter call)
_LAYER = re.compile(r"(?:\.\d+|\[\d+\]|, '\d+'\))$")

# meta key of a node inlined from a repeated block's call: (the subgraph's name, the call's ordinal)
REGION = "autosp_region"


@dataclasses.dataclass
class Call:
    """One call's global nodes (contiguous: the first to the last tagged with the call) and the
    nodes they read from outside, in order of first use."""

    name: str
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    signature: tuple  # what makes two calls' global nodes one: ops, arguments by position, shapes


def _size(x) -> object:
    """A size as itself, or a symbolic one as its expression (printing one costs ~40 us)."""
    return x.node.expr if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool) else x


def _shape(v) -> object:
    if isinstance(v, torch.Tensor):
        return (tuple(map(_size, v.shape)), tuple(map(_size, v.stride())), v.dtype, v.device)
    if isinstance(v, tuple | list):
        return tuple(_shape(x) for x in v)
    return (type(v).__name__, _size(v) if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool) else str(v))


def _call(name: str, nodes: list[fx.Node]) -> Call:
    index = {nd: i for i, nd in enumerate(nodes)}
    inputs: list[fx.Node] = []
    for nd in nodes:
        for a in nd.all_input_nodes:
            if a not in index and a not in inputs:
                inputs.append(a)
    where = {a: ("in", j) for j, a in enumerate(inputs)} | {nd: ("at", i) for nd, i in index.items()}

    def token(a):
        return where[a] if isinstance(a, fx.Node) else a

    ops = tuple(
        (
            nd.op,
            nd.target,
            repr(fx.map_arg(nd.args, token)),
            repr(fx.map_arg(nd.kwargs, token)),
            _shape(nd.meta.get("val")),
        )
        for nd in nodes
    )
    return Call(name, nodes, inputs, (ops, tuple(_shape(a.meta.get("val")) for a in inputs)))


def calls(graph: fx.Graph) -> list[Call]:
    """The calls in ``graph``, in graph order: those ``inline_regions`` tagged (``REGION``), or in a
    graph without tags (every block traced: ``blocks_once=False``), each repeated block's forward
    and backward nodes (``repeated_blocks``, from the module stacks). A call whose nodes
    interleave another's, or that makes a data-dependent size, is left out."""
    order = list(graph.nodes)
    key = _region_key if any(REGION in nd.meta for nd in order) else _module_key(order)
    spans: dict[tuple, list[int]] = {}
    for i, nd in enumerate(order):
        k = key(nd)
        if k is not None:
            spans.setdefault(k, [i, i])[1] = i
    found = []
    for k, (lo, hi) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        nodes = order[lo : hi + 1]
        if any(key(nd) not in (None, k) for nd in nodes) or any(
            nd.op not in ("call_function", "call_method", "get_attr") or free_unbacked_symbols(nd.meta.get("val"))
            for nd in nodes
        ):
            continue
        found.append(_call(k[0], nodes))
    return found


def _region_key(nd: fx.Node) -> tuple | None:
    return nd.meta.get(REGION)


def _module_key(nodes: list[fx.Node]):
    """A node's call by its module stack: (its block's class and forward or backward, the block,
    forward or backward). A backward node without a stack of its own is its forward node's
    (``seq_nr``, which AOTAutograd gives a forward op and the ops of its gradient alike)."""
    ops = [nd for nd in nodes if nd.op == "call_function"]
    names = repeated_blocks(ops)
    by_seq: dict[int, set] = {}
    for nd in ops:
        if nd.meta.get("partitioner_tag") != "is_backward" and "seq_nr" in nd.meta:
            by_seq.setdefault(nd.meta["seq_nr"], set()).add(_block_and_class(nd, names))

    def key(nd: fx.Node) -> tuple | None:
        if nd.op != "call_function":
            return None
        fqn, cls = _block_and_class(nd, names)
        tag = nd.meta.get("partitioner_tag")
        if fqn is None and tag == "is_backward":
            forward = by_seq.get(nd.meta.get("seq_nr"), set())
            fqn, cls = next(iter(forward)) if len(forward) == 1 else (None, None)
        if fqn is None:
            return None
        return (f"{getattr(cls, '__qualname__', cls)} {tag}", fqn, tag)

    return key


def _block_and_class(nd: fx.Node, names: set[str]) -> tuple[str | None, object]:
    fqn = block_of(nd, names)
    return fqn, dict((nd.meta.get("nn_module_stack") or {}).values()).get(fqn) if fqn else None


def block_of(nd: fx.Node, blocks: set[str]) -> str | None:
    """The repeated block a forward node belongs to, outermost first: an item of a ModuleList, or
    one of ``blocks`` (``repeated_blocks``)."""
    for fqn, _ in (nd.meta.get("nn_module_stack") or {}).values():
        if _LAYER.search(fqn) or fqn in blocks:
            return fqn
    return None


def _parent(fqn: str) -> str:
    """The module that holds ``fqn`` as an attribute or an item, as Dynamo names them."""
    held = re.fullmatch(r"getattr\((.*), '[^']*'\)", fqn)
    return held.group(1) if held else re.sub(r"(?:\.\w+|\[[^\]]*\])$", "", fqn)


def repeated_blocks(nodes) -> set[str]:
    """Modules that are blocks whatever they are called: two or more of one class held by the
    same module (``self.first`` and ``self.second`` as well as a ModuleList's items), each with
    modules of its own (not sibling leaves, such as a q and a k projection)."""
    classes: dict[str, object] = {}
    holders: set[str] = set()
    for nd in nodes:
        stack = list((nd.meta.get("nn_module_stack") or {}).values())
        for i, (fqn, cls) in enumerate(stack):
            classes[fqn] = cls
            if i:
                holders.add(stack[i - 1][0])
    siblings: dict[tuple[str, object], list[str]] = {}
    for fqn, cls in classes.items():
        siblings.setdefault((_parent(fqn), str(cls)), []).append(fqn)
    return {fqn for group in siblings.values() if len(group) > 1 for fqn in group if fqn in holders}
