"""Repeated blocks localized once: the per-rank ops of a block traced for one call, copied for
every other call that runs alike.

Localizing traces every op of the step again on this rank's shards (``make_fx`` with symbolic
sizes costs milliseconds an op), so a deep model's localize grew with its depth: 5.8 s of a
symbolic 8-layer compile (sp 8, ``benchmarks/compile_time.py``'s model, the per-rank trace
alone). The step's graph is made of repeated blocks' calls (``_repeats.calls``: those captured
once and inlined, or the blocks of the module tree), and the solver plans alike calls alike
(``propagate._solver``). Here a call is traced as any op is, and the per-rank nodes its trace
added are recorded (a template); a later call of the same block whose global nodes are the
template's (the same ops on the same shapes, in the same order, reading their inputs in the same
way) and whose plan is the template's (each node's strategy, and the placements its inputs
arrive in) gets a copy of those per-rank nodes, with the template's inputs replaced by its own.
The copy is what tracing the call would have made: a node's per-rank ops depend on the node, its
strategy, its inputs' placements and shapes, and the rank only. A call that runs otherwise (the
first backward call, whose input is the loss's gradient) is traced and becomes a template too.
A call is traced where its template read a value that cannot be named as one of its inputs (or
an all-to-all made for one), or made an all-to-all the call would find made already.

Each copied node has its own fake value, of the template's shape, strides and storage offset,
aliasing as the template's did (``_like``); a copied call's values are tracked as the copies'
outputs when an op that is traced reads them (``Lazy``). Sizes (expressions of the lengths) are
the same in every call: the copies read the template's.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
    get_proxy_slot,
    track_tensor_tree,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

from .._repeats import Call, calls

__all__ = ["Lazy", "Stamper"]

aten = torch.ops.aten

# meta a per-rank node takes from the global node it was traced for (``fx.traceback``'s current
# meta): a copy takes its own call's
_FIELDS = (
    "nn_module_stack",
    "source_fn_stack",
    "stack_trace",
    "recompute",
    "ac_graph_id",
    "from_node",
    "custom",
    "partitioner_tag",
    "seq_nr",
    "autograd_backward",
)
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


class _Template:
    """A template call's trace: the per-rank nodes it added (each with the index of the global
    node it was traced for), the values of its global nodes, and how each per-rank node it read
    from before it is named (one of the call's inputs, or an all-to-all of one)."""

    def __init__(self, block: Call):
        self.block = block
        self.added: list[tuple[fx.Node, int]] = []
        self.values: list = []
        self.reads: dict[fx.Node, list[tuple]] = {}  # outside per-rank node -> its names
        self.moved: list[tuple[tuple, torch.Tensor]] = []  # all-to-alls it made: (key by position, value)


class Lazy:
    """A copied call's value, made when a traced op reads it (``Stamper.made``)."""

    __slots__ = ("copies", "value")

    def __init__(self, copies: dict, value):
        self.copies, self.value = copies, value


class Stamper:
    """Copies of traced calls for a ``Localizer`` (see the module docstring). ``run(nd)`` before
    the interpreter runs ``nd``; ``ran(nd)`` after."""

    def __init__(self, interp, graph: fx.Graph):
        self.interp = interp
        self.calls = {c.nodes[0]: c for c in calls(graph)}
        self.templates: dict[str, list[_Template]] = {}  # per subgraph, its traced calls
        self.recording: tuple[_Template, set, fx.Node] | None = None  # (template, all-to-alls before it, its last node)
        self.stamped: set[fx.Node] = set()
        self.made: dict[fx.Node, torch.Tensor] = {}  # per-rank node -> its value (a copy's, or one read)
        self.copied = 0  # calls copied, for the tests and the debug log

    # -- the interpreter's hooks

    def run(self, nd: fx.Node) -> bool:
        """Before ``nd`` runs: start recording a template, or copy a call; whether ``nd``'s value
        is set already (a copied call's node)."""
        if nd in self.stamped:
            return True
        block = self.calls.get(nd)
        if block is None or self.recording is not None:
            return False
        for t in self.templates.get(block.name, ()):
            if self._copy(block, t):
                self.stamped.update(block.nodes)
                self.copied += 1
                return True
        # the first call of its subgraph, or one that runs otherwise: traced, and a template
        self.recording = (_Template(block), set(self.interp.moved), block.nodes[-1])
        return False

    def last(self) -> fx.Node:
        """The per-rank graph's last node."""
        return _last(self._graph())

    def ran(self, nd: fx.Node, before: fx.Node, value) -> None:
        """After ``nd`` ran to ``value`` (``before``: the per-rank graph's last node before it):
        the nodes it added, and at a template's last node, its record."""
        t, moved, last = self.recording
        index = len(t.values)
        node = before.next
        graph = self._graph()
        while node is not graph._root:
            t.added.append((node, index))
            node = node.next
        t.values.append(value)
        if nd is last:
            self.recording = None
            if self._reads(t, moved):
                self.templates.setdefault(t.block.name, []).append(t)

    # -- a template's record

    @property
    def tracer(self):
        return get_proxy_mode().tracer

    def _graph(self) -> fx.Graph:
        return self.tracer.graph

    def _proxy_node(self, v) -> fx.Node | None:
        slot = get_proxy_slot(v, self.tracer, None) if isinstance(v, torch.Tensor) else None
        return None if slot is None else slot.proxy.node

    def _reads(self, t: _Template, moved_before: set) -> bool:
        """Names the per-rank nodes from before the template that its nodes read, and the
        all-to-alls it made; whether every one was named."""
        names: dict[fx.Node, list[tuple]] = {}
        env, moved = self.interp.env, self.interp.moved
        position = {a: j for j, a in enumerate(t.block.inputs)}
        for j, a in enumerate(t.block.inputs):
            v = env.get(a)
            if isinstance(v, Lazy):  # never read as a tensor by the template: not a name of what it read
                continue
            for i, leaf in enumerate(v if isinstance(v, tuple | list) and a.target is not operator.getitem else [v]):
                if isinstance(leaf, torch.Tensor) and (p := self._proxy_node(leaf)) is not None:
                    names.setdefault(p, []).append(("in", j, i))
        for u, i, q in moved_before:
            if u in position:
                v = moved[(u, i, q)]
                if not isinstance(v, Lazy) and (p := self._proxy_node(v)) is not None:
                    names.setdefault(p, []).append(("moved", position[u], i, q))
        added = {nd for nd, _ in t.added}
        at = {nd: i for i, nd in enumerate(t.block.nodes)}
        for key in set(moved) - moved_before:
            u, i, q = key
            where = ("at", at[u]) if u in at else ("in", position[u]) if u in position else None
            if where is None or self._proxy_node(moved[key]) not in added:
                return False
            t.moved.append(((where, i, q), moved[key]))
        # what the added nodes read, and the values the call leaves (a value passed through is
        # a node from before it)
        # (a real tensor an op returned, untracked: a CUDA kernel's empty RNG state, the same in
        # every call)
        leaves = [x for v in t.values for x in _tensors(v) if isinstance(x, FakeTensor)] + [v for _, v in t.moved]
        read = [a for nd, _ in t.added for a in nd.all_input_nodes] + [self._proxy_node(x) for x in leaves]
        for a in read:
            if a is None:
                return False
            if a in added or a in t.reads or _same_everywhere(a):
                continue
            if a not in names:
                return False
            t.reads[a] = names[a]
        return True

    # -- a copy

    def _alike(self, block: Call, t: _Template) -> bool:
        """Whether ``block`` runs as the template on this rank: the same global nodes, the same
        strategies, its inputs arriving in the same placements."""
        plan, base = self.interp.plan, t.block
        return (
            block.signature == base.signature
            and all(plan.get(a) == plan.get(b) for a, b in zip(block.nodes, base.nodes, strict=True))
            and all(
                (plan[a].outs if a in plan else None) == (plan[b].outs if b in plan else None)
                for a, b in zip(block.inputs, base.inputs, strict=True)
            )
        )

    def _copy(self, block: Call, t: _Template) -> bool:
        """The template's per-rank nodes copied for ``block``; False (nothing done) where the
        block does not run alike or its inputs cannot stand for the template's."""
        if not self._alike(block, t):
            return False
        interp = self.interp
        keys = {}
        for (where, i, q), v in t.moved:
            u = block.nodes[where[1]] if where[0] == "at" else block.inputs[where[1]]
            if (u, i, q) in interp.moved:  # an all-to-all made already: tracing would read it, not make it
                return False
            keys[(u, i, q)] = v
        copies: dict[fx.Node, fx.Node] = {}
        # a template value's storage -> a tensor of the copy's on the storage that stands for it
        storages: dict[StorageWeakRef, torch.Tensor] = {}
        for a, names in t.reads.items():
            got = set()
            for name in names:
                u = block.inputs[name[1]]
                if name[0] == "in":
                    v = interp.value(u, name[2])
                else:
                    key = (u, name[2], name[3])
                    if key not in interp.moved:
                        return False
                    v = self.value(interp.moved[key])
                    interp.moved[key] = v
                p = self._proxy_node(v) if isinstance(v, torch.Tensor) else None
                if p is None:
                    return False
                self.made.setdefault(p, v)
                got.add(p)
            if len(got) != 1:
                return False
            copies[a] = got.pop()
            if isinstance(a.meta.get("val"), torch.Tensor):
                storages.setdefault(_storage(a.meta["val"]), self.made[copies[a]])
        graph = self._graph()
        for nd, index in t.added:
            if _is_sym(nd):  # a size: an expression of the lengths, the same in every call
                copies[nd] = nd
                continue
            c = graph.node_copy(nd, lambda a: copies.get(a, a))
            own = block.nodes[index].meta
            c.meta = {k: v for k, v in nd.meta.items() if k not in _FIELDS}
            c.meta.update((k, copy.copy(own[k])) for k in _FIELDS if k in own)
            # its own fake value: one object shared by two nodes would be one tensor to a later
            # trace of the graph (Inductor's retrace: two saved activations read as one)
            c.meta["val"] = tree_map(lambda x: _like(x, storages), nd.meta.get("val"))
            copies[nd] = c
        for g, v in zip(block.nodes, t.values, strict=True):
            interp.env[g] = Lazy(copies, v) if _has_tensor(v) else v
        for key, v in keys.items():
            interp.moved[key] = Lazy(copies, v)
        return True

    def value(self, v):
        """``v`` with a copied call's values made: each tensor a fresh fake tensor of the
        template's shape, tracked as its copy's output (made once per copy)."""
        if not isinstance(v, Lazy):
            return v
        copies, tracer = v.copies, self.tracer

        def make(x):
            if not isinstance(x, torch.Tensor):
                return x
            p = self._proxy_node(x)
            c = copies.get(p, p)  # a constant: the template's own
            if c is p:
                return x
            if c in self.made:
                return self.made[c]
            y = c.meta["val"]
            track_tensor_tree(y, fx.Proxy(c, tracer), constant=None, tracer=tracer)
            self.made[c] = y
            return y

        return tree_map(make, v.value)


def _storage(x: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(x.untyped_storage())


def _like(x, storages: dict) -> object:
    """A fake tensor of ``x``'s shape, strides and offset for a copy, on the storage that stands for
    ``x``'s in the copy (a view of a copied value, or of a value the copy read, is a view of the
    copy's), or on a new one of the same size: the template's aliasing, the copy's tensors. Made
    by the meta kernels directly, as torch's fake ``detach`` is (a fake tensor op with symbolic
    sizes costs about a millisecond)."""
    if not isinstance(x, FakeTensor):
        return x
    key = _storage(x)
    base = storages.get(key)
    mode = x.fake_mode
    with disable_proxy_modes_tracing(), no_python_dispatcher(), in_kernel_invocation_manager(mode):
        offset = x.storage_offset()
        if base is None and not x._is_view() and isinstance(offset, int) and offset == 0:  # an op's own output
            out = storages[key] = aten.empty_strided.default(x.shape, x.stride(), dtype=x.dtype, device="meta")
        elif base is None or base.dtype != x.dtype:  # a view of a storage not seen, or as another dtype
            size = x.untyped_storage().nbytes() // x.element_size()
            base = aten.empty_strided.default((size,), (1,), dtype=x.dtype, device="meta")
            storages.setdefault(key, base)
            out = aten.as_strided.default(base, x.shape, x.stride(), offset)
        else:
            out = aten.as_strided.default(base, x.shape, x.stride(), offset)
    return FakeTensor(mode, out, x.device)


def _last(graph: fx.Graph) -> fx.Node:
    return graph._root.prev


def _is_sym(nd: fx.Node) -> bool:
    return isinstance(nd.meta.get("val"), _SYM)


def _same_everywhere(a: fx.Node) -> bool:
    """A per-rank node every call reads as it is: a size (an expression of the lengths) or a
    constant."""
    return a.op == "get_attr" or _is_sym(a)


def _tensors(v) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    return [x for y in v for x in _tensors(y)] if isinstance(v, tuple | list) else []


def _has_tensor(v) -> bool:
    return bool(_tensors(v))
