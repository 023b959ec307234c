"""Repeated blocks captured once: Dynamo's graph with each repeated block a call of one shared
subgraph (``outline_blocks``), and the ``invoke_subgraph`` calls in the graphs AOTAutograd then
hands the backend made one flat graph again (``inline_regions``).

Tracing the step's joint graph is most of a compile's capture, and it grows with depth: with every
block traced, the capture of 32 layers took 18.7 s (sp 8, symbolic; ``benchmarks/compile_time.py
--kinds symbolic-each``), where a Dynamo-only compile of the same model takes 3.7 s.
``outline_blocks`` finds the blocks as the checkpointing pass does (from the module
stacks), and where two or more have the same ops on inputs of the same shapes, replaces each by an
``invoke_subgraph`` call of the first one's ops: what ``torch.compiler.nested_compile_region``
makes, and what a user may have written. A block is left as it is where its ops are not
contiguous in the graph, write to a tensor in place, draw random numbers, call a module or a
higher-order op other than FlexAttention, or return a size.

AOTAutograd traces a region's joint graph once for all its calls, and hands the partitioner the
step's joint graph with each call an ``invoke_subgraph`` of the region's forward (in the forward)
and of its backward (in the backward). autosp's passes read one flat graph of ATen ops, so
``inline_regions`` copies each call's subgraph in its place: the graph is the one a full trace
would have made, but for the node names, and the passes plan it as they plan any. The region's
own joint graph is split plainly (``default_partition``: what its backward reads, saved); the flat
graph's checkpointing is decided later, on the whole step, as for any graph.

A region's nodes were traced at one call (``blocks.0``): each copy's module stack is its own
call's (``blocks.1``), so the checkpointing pass sees each layer as its own block.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import re

import torch
import torch.fx as fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .._repeats import REGION, block_of, repeated_blocks

__all__ = ["outline_blocks", "inline_regions", "is_region_joint", "schema_once", "graph_copy"]

_PREFIX = "autosp_block_"

_CALLS = ("call_function", "call_method")
# ops a shared subgraph does not take: writes in place (``add_``, ``+=``, ``x[i] = v``), random draws
_UNSAFE = re.compile(
    r"(?:^|\.)(?:\w*[^_]_|(?:__)?(?:setitem|delitem|i(?:add|sub|mul|truediv|floordiv|and|or|xor|lshift|rshift|pow|mod|matmul))(?:__)?)$"
)
_RANDOM = re.compile(
    r"dropout|rand|bernoulli|normal(?!ize)|multinomial|uniform|exponential|poisson|cauchy|geometric|rrelu|gumbel"
)
# global state set inside a block (grad mode, autocast, the generator): a subgraph would not hold it
_STATE = re.compile(r"grad_enabled|autocast|manual_seed|rng_state|_set_")


def is_region_joint(joint_inputs) -> bool:
    """Whether a partition call is for a region's own joint graph: AOTAutograd passes those no
    example inputs (``run_joint_graph_passes_on_hops``, torch 2.13)."""
    return len(joint_inputs) == 0


def _restacked(stack: dict | None, site: dict | None) -> dict | None:
    """A region node's module stack, traced at one call, as the call at ``site`` has it: the
    traced block's entry and those under it renamed from that block's path to the site's."""
    if not stack or not site:
        return stack or site
    here, there = list(site.items()), list(stack.items())
    depth = len(here)
    if len(there) < depth or [v[0] for _, v in there[: depth - 1]] != [v[0] for _, v in here[:-1]]:
        return stack  # called from elsewhere than where it was traced: left as traced
    traced, block = there[depth - 1][1][0], here[-1][1][0]
    inner = {
        f"{key}@{block}": ((block + fqn[len(traced) :]) if fqn.startswith(traced) else fqn, cls)
        for key, (fqn, cls) in there[depth:]
    }
    return {**site, **inner}


def _sites(gm: fx.GraphModule) -> dict:
    """Each region call's module stack by its call id (a backward call has none of its own: its
    forward's)."""
    return {
        nd.meta["custom"]["call_id"]: nd.meta["nn_module_stack"]
        for nd in gm.graph.find_nodes(op="call_function", target=invoke_subgraph)
        if nd.meta.get("nn_module_stack") and "call_id" in (nd.meta.get("custom") or {})
    }


def _inline(gm: fx.GraphModule, call: fx.Node, site: dict | None, attrs: dict, region: tuple) -> None:
    """One ``invoke_subgraph`` call replaced by a copy of its subgraph, each node tagged with
    ``region`` (``_stamp.REGION``: the subgraph and the call; a call inside an inlined one keeps
    its outer call's)."""
    sub = getattr(gm, call.args[0].target)
    region = call.meta.get(REGION, region)
    env = dict(zip(sub.graph.find_nodes(op="placeholder"), call.args[2:], strict=True))
    graph = gm.graph
    with graph.inserting_before(call):
        for nd in sub.graph.nodes:
            if nd.op == "placeholder":
                continue
            if nd.op == "output":
                results = fx.map_arg(nd.args[0], env.__getitem__)
                break
            if nd.op == "get_attr":  # a region's own submodule (a score function's graph)
                key = (id(sub), nd.target)
                if key not in attrs:
                    attrs[key] = f"_region_{len(attrs)}_{nd.target}"
                    value = getattr(sub, nd.target)
                    if isinstance(value, torch.nn.Module):
                        gm.register_module(attrs[key], value)
                    elif isinstance(value, torch.nn.Parameter):
                        gm.register_parameter(attrs[key], value)
                    elif isinstance(value, torch.Tensor):  # a constant the region lifted
                        gm.register_buffer(attrs[key], value, persistent=False)
                    else:
                        setattr(gm, attrs[key], value)
                env[nd] = graph.get_attr(attrs[key])
                env[nd].meta = dict(nd.meta)
                continue
            copy = graph.node_copy(nd, env.__getitem__)
            copy.meta = dict(nd.meta)
            stack = _restacked(nd.meta.get("nn_module_stack"), site)
            if stack is not None:
                copy.meta["nn_module_stack"] = stack
            if "partitioner_tag" in call.meta:
                copy.meta["partitioner_tag"] = call.meta["partitioner_tag"]
            copy.meta[REGION] = region
            env[nd] = copy
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise NotImplementedError(
                f"autosp: a nested_compile_region call's output is read by {user.format_node()}, not by index"
            )
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(call)


def inline_regions(gm: fx.GraphModule) -> int:
    """Every ``invoke_subgraph`` call in ``gm`` (and in the regions it calls) replaced by a copy of
    its subgraph; the number of calls inlined. Mutates ``gm``."""
    count, attrs, ordinals = 0, {}, {}
    while calls := gm.graph.find_nodes(op="call_function", target=invoke_subgraph):
        sites = _sites(gm)
        for call in calls:
            site = sites.get((call.meta.get("custom") or {}).get("call_id")) or call.meta.get("nn_module_stack")
            name = call.args[0].target
            ordinals[name] = ordinals.get(name, -1) + 1
            _inline(gm, call, site, attrs, (name, ordinals[name]))
        count += len(calls)
    if count:
        for nd in gm.graph.find_nodes(op="get_attr"):
            if not nd.users:
                gm.graph.erase_node(nd)
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return count


def _tail(fqn: str) -> str:
    """A block's name as its holder calls it: 'blocks.0' of Dynamo's 'fn.__closure__[0]...blocks.0'."""
    named = re.search(r"\w+(?:\.\d+|\[\d+\])?$", fqn)
    return named.group(0) if named else fqn


def _name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", None) or str(target)


# higher-order ops a shared subgraph may hold (AOTAutograd traces them inside invoke_subgraph)
_HOPS = (torch.ops.higher_order.flex_attention,)
# positional names of builtins whose signature Python cannot read
_POSITIONAL = {"scaled_dot_product_attention": ("query", "key", "value", "attn_mask", "dropout_p")}


def _bound(nd: fx.Node) -> dict:
    """The node's arguments by name, where its target's signature names them."""
    try:
        return inspect.signature(nd.target).bind_partial(*nd.args, **nd.kwargs).arguments
    except (TypeError, ValueError):
        return {**dict(zip(_POSITIONAL.get(_name(nd.target), ()), nd.args)), **nd.kwargs}


def _draws(nd: fx.Node, name: str, args: dict) -> bool:
    """Whether the op draws random numbers: a dropout of probability 0 or out of training (HF's
    ``dropout(x, p=0.0, training=self.training)``) does not; attention with ``dropout_p`` does."""
    if args.get("dropout_p", 0) != 0:
        return True
    if not _RANDOM.search(name):
        return False
    if "dropout" in name and nd.op == "call_function":
        return not (args.get("p", 0.5) == 0 or args.get("training", True) is False)
    return True


def _safe(nd: fx.Node) -> bool:
    """Whether a node of Dynamo's graph can be one of a shared subgraph's: a call that writes to
    no tensor, draws no random number, sets no global state and takes no subgraph."""
    if nd.op == "get_attr":  # a higher-order op's function (FlexAttention's score and mask)
        return isinstance(nd.graph.owning_module.get_submodule(nd.target), fx.GraphModule)
    if nd.op not in _CALLS:
        return False
    if isinstance(nd.target, torch._ops.HigherOrderOperator):
        return nd.target in _HOPS
    if isinstance(nd.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        op = nd.target if isinstance(nd.target, torch._ops.OpOverload) else nd.target.default
        return not op._schema.is_mutable and torch.Tag.nondeterministic_seeded not in op.tags
    name, args = _name(nd.target), (_bound(nd) if nd.op == "call_function" else dict(nd.kwargs))
    return not (
        _UNSAFE.search(name) or _STATE.search(name) or _draws(nd, name, args) or args.get("inplace") or "out" in args
    )


def _takes(v) -> bool:
    """Whether ``invoke_subgraph`` takes the value as an operand: a tensor, an int or a SymInt
    (not a float, a bool, a size or None)."""
    return isinstance(v, torch.Tensor | int | torch.SymInt) and not isinstance(v, bool)


def _meta(v) -> object:
    """What a value is: shape, strides, dtype, device and grad of a tensor (of each, in a tuple)."""
    if isinstance(v, torch.Tensor):
        return (str(tuple(v.shape)), str(v.stride()), v.dtype, v.device, v.requires_grad)
    if isinstance(v, tuple | list):
        return tuple(_meta(x) for x in v)
    return (type(v).__name__, str(v))


class _Block:
    """One block's ops in Dynamo's graph: its nodes in order, the values it reads from outside
    (in order of first use) and those read after it, and what makes two blocks one subgraph."""

    def __init__(self, fqn: str, nodes: list[fx.Node]):
        self.fqn, self.nodes = fqn, nodes
        inside = set(nodes)
        self.inputs: list[fx.Node] = []
        for nd in nodes:
            for a in nd.all_input_nodes:
                if a not in inside and a not in self.inputs:
                    self.inputs.append(a)
        self.outputs = [nd for nd in nodes if any(u not in inside for u in nd.users)]
        index = {nd: ("local", i) for i, nd in enumerate(nodes)} | {a: ("in", i) for i, a in enumerate(self.inputs)}

        def token(a):
            return index[a] if isinstance(a, fx.Node) else repr(a)

        def op(nd):  # a function's graph by its code: each block holds its own copy, named apart
            if nd.op == "get_attr":
                return nd.graph.owning_module.get_submodule(nd.target).code
            return nd.target

        ops = tuple(
            (nd.op, op(nd), repr(fx.map_arg(nd.args, token)), repr(fx.map_arg(nd.kwargs, token))) for nd in nodes
        )
        # every value's meta, not only the inputs': a block run under no_grad or autocast at one
        # call (set outside it) computes its values otherwise, from alike inputs
        self.key = (
            ops,
            tuple(_meta(a.meta.get("example_value")) for a in (*self.inputs, *nodes)),
            tuple(index[o] for o in self.outputs),
        )


def _blocks(gm: fx.GraphModule) -> list[_Block]:
    """The repeated blocks of Dynamo's graph whose ops are contiguous and can be shared."""
    calls = [nd for nd in gm.graph.nodes if nd.op in _CALLS or nd.op in ("call_module", "get_attr")]
    names = repeated_blocks(calls)
    where: dict[str, list[int]] = {}
    for i, nd in enumerate(calls):
        fqn = block_of(nd, names)
        if fqn is not None:
            where.setdefault(fqn, []).append(i)
    found = []
    for fqn, at in where.items():
        nodes = [calls[i] for i in at]
        if at[-1] - at[0] + 1 != len(at) or not all(_safe(nd) for nd in nodes):
            continue
        block = _Block(fqn, nodes)
        if (
            block.outputs
            and all(isinstance(o.meta.get("example_value"), torch.Tensor) for o in block.outputs)
            and all(_takes(a.meta.get("example_value")) for a in block.inputs)
            and not any(free_unbacked_symbols(nd.meta.get("example_value")) for nd in nodes)
        ):
            found.append(block)
    return found


def _subgraph(block: _Block, moved: dict) -> fx.GraphModule:
    """The block's ops as a graph of its inputs; ``moved``: an earlier outlined block's outputs,
    now items of its call, which this block's nodes read."""
    graph = fx.Graph()
    env = {}
    for i, a in enumerate(block.inputs):
        env[moved.get(a, a)] = graph.placeholder(f"arg{i}")
        env[moved.get(a, a)].meta = dict(a.meta)
    for nd in block.nodes:
        env[nd] = graph.node_copy(nd, env.__getitem__)
    graph.output(tuple(env[o] for o in block.outputs))
    owner = block.nodes[0].graph.owning_module
    return fx.GraphModule(
        {nd.target: owner.get_submodule(nd.target) for nd in block.nodes if nd.op == "get_attr"}, graph
    )


def graph_copy(graph: fx.Graph) -> fx.Graph:
    """A copy of Dynamo's graph that AOTAutograd reads as Dynamo's: each placeholder with its
    ``_dynamo_source`` (an attribute of the node, which copies drop; AOTAutograd finds the
    parameters by it)."""
    copied = copy.deepcopy(graph)
    for old, new in zip(graph.find_nodes(op="placeholder"), copied.find_nodes(op="placeholder"), strict=True):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copied


def outline_blocks(gm: fx.GraphModule) -> tuple[str, ...]:
    """Each group of two or more alike repeated blocks of Dynamo's graph ``gm`` replaced by calls
    of one ``invoke_subgraph`` (see the module docstring); a note per group. Mutates ``gm``."""
    groups: dict[tuple, list[_Block]] = {}
    for block in _blocks(gm):
        groups.setdefault(block.key, []).append(block)
    notes, moved = [], {}  # a block's output -> the item of its call that replaced it
    for g, blocks in enumerate(b for b in groups.values() if len(b) > 1):
        name = f"{_PREFIX}{g}"
        gm.register_module(name, _subgraph(blocks[0], moved))
        for block in blocks:
            first = block.nodes[0]
            site = first.meta.get("nn_module_stack") or {}
            depth = next(i for i, (fqn, _) in enumerate(site.values()) if fqn == block.fqn) + 1
            with gm.graph.inserting_before(first):
                sub = gm.graph.get_attr(name)
                call = gm.graph.call_function(invoke_subgraph, (sub, name, *(moved.get(a, a) for a in block.inputs)))
            call.meta = {
                "nn_module_stack": dict(list(site.items())[:depth]),
                "stack_trace": first.meta.get("stack_trace"),
                "example_value": tuple(o.meta["example_value"] for o in block.outputs),
            }
            for i, out in enumerate(block.outputs):
                with gm.graph.inserting_before(first):
                    item = gm.graph.call_function(operator.getitem, (call, i))
                item.meta = dict(out.meta)
                moved[out] = item
                out.replace_all_uses_with(item, delete_user_cb=lambda u, block=block: u not in block.nodes)
            for nd in reversed(block.nodes):
                gm.graph.erase_node(nd)
        cls = dict((blocks[0].nodes[0].meta.get("nn_module_stack") or {}).values()).get(blocks[0].fqn)
        notes.append(
            f"{len(blocks)} blocks {getattr(cls, '__name__', '')} ({_tail(blocks[0].fqn)}, ...) captured once (one "
            "subgraph traced for all), then planned as one graph"
        )
    if notes:
        gm.graph.lint()
        gm.recompile()
    return tuple(notes)


@contextlib.contextmanager
def schema_once():
    """Within it, an outlined block's schema is made once, not at every call. AOTAutograd's
    autograd rule for ``invoke_subgraph`` makes the subgraph's schema at each call (to refuse
    one that writes to its inputs; torch 2.13, ``HigherOrderOperator.py_autograd_impl``), by
    tracing the subgraph again: 6.8 of a 16-layer step's 10.2 s in AOTAutograd
    (``benchmarks/compile_time.py``'s model, sp 8, symbolic, profiled). Every call of one outlined
    block runs the same ops on inputs of the same shapes (``_Block.key``), and none writes in place
    (``_safe``), so the first call's answer is every call's. A user's own regions are left to
    torch."""
    made: dict[tuple, object] = {}
    own = invoke_subgraph.__dict__.get("gen_schema")  # an enclosing schema_once's
    schema = invoke_subgraph.gen_schema

    def once(subgraph, identifier, *operands):
        if not (isinstance(identifier, str) and identifier.startswith(_PREFIX)):
            return schema(subgraph, identifier, *operands)
        # one compile's identifiers name one subgraph each; functionalization's calls put an effect
        # token first: a schema per operand kinds
        key = (identifier, tuple(type(o).__name__ for o in operands))
        if key not in made:
            made[key] = schema(subgraph, identifier, *operands)
        return made[key]

    invoke_subgraph.gen_schema = once  # torch.compile is not thread-safe: one compile at a time
    try:
        yield
    finally:
        if own is None:
            del invoke_subgraph.gen_schema  # the class's again
        else:
            invoke_subgraph.gen_schema = own
