"""A loss computed in chunks along the sequence, as one: the captured step's ``split`` of a tensor
into chunks, each through the same row-local ops, concatenated back along the rows, becomes those
ops on the whole tensor, before AOTAutograd traces the step.

litgpt's ``chunked_cross_entropy`` (its default loss, ``chunk_size=128``) splits the flattened
logits and targets into 128-row chunks, takes ``cross_entropy(..., reduction="none")`` of each and
concatenates the results. Along a sharded sequence, a split into several windows is a split of the
rows across ranks, and autosp gathered the logits for it (the largest activation, on every rank:
1.66x Ulysses' bytes for 16-row chunks at 64 tokens over 2 ranks, the whole logits at any real
length). Row by row, the chunked loss and the whole one compute the same values in the same order,
so the rewrite is exact (bitwise), and the sequence stays sharded through the loss. Memory is the
tiled rungs' concern (``partition._tiling``: the loss tile by tile), not the user's chunks'.

Row-local here: ``cross_entropy`` and ``nll_loss`` with ``reduction="none"`` on (rows, classes);
``log_softmax`` / ``softmax`` along another dim; elementwise ops of a chunk and numbers; dtype
casts; a linear layer (a head: each row times its weight); a reshape that merges a batch of one
into the rows (``logits.reshape(-1, vocab)``). The last chunk may be cut short along the rows
(``logits[-1] = logits[-1][..., :-1, :]``: litgpt's LoRA recipe runs its head in chunks,
``lm_head_chunk_size``, and cuts the last for the shift), when its partner split's chunks are
that much shorter: the whole is cut there once. A reshape that merges a batch of several may
too where the concatenation is only summed (its rows' order is then not read). The other way
users write it, a sum of per-chunk sums (``loss = loss + cross_entropy(x, y,
reduction="sum")`` in a loop, Python's ``sum`` of them, ``.sum()`` of a row-local chunk),
becomes the sum over the whole tensor: the same terms, added in another order (as the ranks'
partial sums are anyway). Anything else in a chunk's ops (a mean per chunk weighs the chunks
alike), a chunk's value used outside them, chunks whose ops differ, or a concatenation along
another dim leaves the graph as it is (and the split to its rule)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..errors import source_line

__all__ = ["unchunk"]

_SPLITS = {torch.split, torch.chunk, "split", "chunk"}
_CATS = {torch.cat, torch.concat, torch.concatenate}
_ELEMENTWISE = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.neg,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.neg,
    torch.exp,
    torch.log,
    "float",
    "to",
    "type_as",
    "neg",
    "mul",
    "add",
    "div",
    "sub",
}
_ELEMENTWISE |= {torch.tanh, "tanh"}  # soft-capping (Gemma's logits)
_LINEAR = {F.linear, torch._C._nn.linear}  # a head: each row times a weight
_RESHAPES = {"reshape", "view", torch.reshape, "flatten", torch.flatten}
_PER_ROW_LOSSES = {F.cross_entropy, F.nll_loss}
_SOFTMAXES = {F.log_softmax, F.softmax, torch.log_softmax, torch.softmax, "log_softmax", "softmax"}
_SUMS = {torch.sum, "sum"}
_ADDS = {operator.add, operator.iadd, torch.add, "add"}  # `loss += x` is iadd
_WALKED = _ELEMENTWISE | _PER_ROW_LOSSES | _SOFTMAXES | _SUMS | _LINEAR | _RESHAPES | {operator.getitem}


def _target(nd: fx.Node):
    return nd.target if nd.op in ("call_function", "call_method") else None


def _arg(nd: fx.Node, i: int, name: str, default=None):
    return nd.args[i] if len(nd.args) > i else nd.kwargs.get(name, default)


def _example(nd) -> torch.Tensor | None:
    v = nd.meta.get("example_value") if isinstance(nd, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _split_dim(nd: fx.Node) -> int | None:
    """The dim a split or chunk node splits along (non-negative), or None if ``nd`` is not one."""
    if not isinstance(nd, fx.Node) or _target(nd) not in _SPLITS:
        return None
    x = _example(nd.args[0])
    if x is None:
        return None
    return _arg(nd, 2, "dim", 0) % x.ndim


def _split_alike(splits: set[fx.Node], cut: dict[fx.Node, int] | None = None) -> bool:
    """Whether the splits cut their inputs at the same rows: one dim, and chunk by chunk the same
    sizes along it (known without a guard); ``cut``: a split whose last chunk is read ``k`` rows
    short (``_tail_cut``)."""
    dims = {_split_dim(s) for s in splits}
    if len(dims) != 1:
        return False
    (dim,) = dims
    sizes = []
    for s in splits:
        chunks = s.meta.get("example_value")
        if not isinstance(chunks, (list, tuple)) or not all(isinstance(c, torch.Tensor) for c in chunks):
            return False
        sizes.append([c.shape[dim] for c in chunks])
        if cut and s in cut:
            sizes[-1][-1] = sizes[-1][-1] - cut[s]
    return all(
        len(other) == len(sizes[0]) and all(statically_known_true(a == b) for a, b in zip(other, sizes[0]))
        for other in sizes[1:]
    )


def _row_dim(nd: fx.Node, rows: dict[fx.Node, int], any_order: bool = False) -> int | None:
    """The dim of ``nd``'s result whose entries depend on one row of its chunked inputs each (the
    chunked inputs' rows along ``rows[input]``), or None if ``nd`` mixes rows; ``any_order``: the
    result is only summed, so rows may come in another order (``_reshaped_row_dim``)."""
    dims = {rows[a] for a in nd.all_input_nodes if a in rows}
    if len(dims) != 1:
        return None
    (d,) = dims
    t = _target(nd)
    if t in _LINEAR:  # the weight and bias are the head's, the rows the chunk's
        x = _example(nd.args[0])
        return d if nd.args[0] in rows and x is not None and d < x.ndim - 1 else None
    if t in _RESHAPES:
        return _reshaped_row_dim(nd, d, any_order)
    if any(a not in rows and _example(a) is not None for a in nd.all_input_nodes):
        # a tensor from outside the chunk: only a loss's own weight would be row-local; refuse
        return None
    if t in _ELEMENTWISE:  # no broadcasting of a chunk against another's rows
        ndims = {v.ndim for v in map(_example, [nd, *nd.all_input_nodes]) if v is not None}
        return d if len(ndims) == 1 else None
    if t in _SOFTMAXES:
        x = _example(nd.args[0])
        dim = _arg(nd, 1, "dim")
        return d if x is not None and dim is not None and dim % x.ndim != d else None
    if t in _PER_ROW_LOSSES:
        x = _example(nd.args[0])
        none = nd.kwargs.get("reduction", "mean") == "none" and len(nd.args) <= 2
        return 0 if none and x is not None and x.ndim == 2 and d == 0 else None
    return None


def _reshaped_row_dim(nd: fx.Node, d: int, any_order: bool = False) -> int | None:
    """The row dim after a reshape (or flatten) that only merges the leading dims into the rows'
    and keeps the trailing ones (``logits.reshape(-1, vocab)`` of (batch, rows, vocab)): 0, where
    the batch is one or the result is only summed (``any_order``: merging a batch of several
    interleaves the chunks' rows, the concatenation then in another order than the whole's);
    None for any other."""
    x, y = _example(nd.args[0]), _example(nd)
    if x is None or y is None or y.ndim != x.ndim - d:
        return None
    leading_ones = any_order or all(statically_known_true(n == 1) for n in x.shape[:d])
    trailing = all(statically_known_true(a == b) for a, b in zip(x.shape[d + 1 :], y.shape[1:]))
    return 0 if leading_ones and trailing else None


def _tail_cut(nd: fx.Node, rows: dict[fx.Node, int]) -> int | None:
    """k where ``nd`` is ``x[..., :-k, ...]`` along ``x``'s rows (the last chunk cut for a shift,
    as litgpt's LoRA recipe writes ``logits[-1] = logits[-1][..., :-1, :]``), else None."""
    if _target(nd) is not operator.getitem or nd.args[0] not in rows:
        return None
    x, index = _example(nd.args[0]), nd.args[1]
    if x is None or not isinstance(index, tuple):
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (x.ndim - len(index) + 1) + index[at + 1 :]
    d = rows[nd.args[0]]
    if len(index) > x.ndim or not all(isinstance(i, slice) for i in index) or len(index) <= d:
        return None
    full = slice(None)
    cut = index[d]
    if any(i != full for j, i in enumerate(index) if j != d) or cut.start not in (None, 0) or cut.step not in (None, 1):
        return None
    return -cut.stop if isinstance(cut.stop, int) and cut.stop < 0 else None


def _cone(
    out: fx.Node, index: int, sinks: set[fx.Node], order: dict[fx.Node, int]
) -> tuple[list[fx.Node], dict[fx.Node, fx.Node]] | None:
    """The ops that make ``out`` from the ``index``-th chunks of splits, in graph order, and the
    chunk each reads -> its split; None if a value among them is used elsewhere than by them and
    (``out`` alone) by ``sinks``."""
    ops, chunks, todo = set(), {}, [out]
    while todo:
        nd = todo.pop()
        if nd in ops or nd in chunks:
            continue
        if nd.op == "call_function" and nd.target is operator.getitem and _split_dim(nd.args[0]) is not None:
            if nd.args[1] != index:
                return None
            chunks[nd] = nd.args[0]
            continue
        if _target(nd) not in _WALKED:  # the walk stops at once off the chunks' ops (a rotary cat's slices)
            return None
        ops.add(nd)
        todo.extend(nd.args[:1] if _target(nd) in _LINEAR else nd.all_input_nodes)  # a head's weight is no chunk's
    for nd in [*ops, *chunks]:
        if any(u not in ops and (nd is not out or u not in sinks) for u in nd.users):
            return None
    return sorted(ops, key=order.__getitem__), chunks


def _same_ops(a: list[fx.Node], b: list[fx.Node], to_a: dict[fx.Node, fx.Node], cut: fx.Node | None = None) -> bool:
    """Whether ops ``b`` do what ops ``a`` do, ``to_a`` mapping ``b``'s chunks to ``a``'s; ``cut``,
    one of ``b``, is read as its input (``_tail_cut``)."""
    if cut is not None:
        b = [y for y in b if y is not cut]
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if cut is not None and cut in y.all_input_nodes:
            to_a[cut] = to_a.get(cut.args[0], cut.args[0])
        if _target(x) != _target(y) or x.op != y.op:
            return False
        mapped = fx.node.map_arg((y.args, y.kwargs), lambda n: to_a.get(n, n))
        if mapped != (x.args, x.kwargs):
            return False
        to_a[y] = x
    return True


def _summed(nd: fx.Node, rows: dict[fx.Node, int]) -> bool:
    """Whether ``nd`` sums every entry of its row-local input: a per-row loss with ``reduction=
    "sum"`` on (rows, classes), or ``sum()`` without a dim."""
    t, x = _target(nd), _example(nd.args[0]) if nd.args else None
    if any(a not in rows and _example(a) is not None for a in nd.all_input_nodes) or x is None:
        return False
    if t in _PER_ROW_LOSSES:
        return nd.kwargs.get("reduction") == "sum" and len(nd.args) <= 2 and x.ndim == 2 and rows[nd.args[0]] == 0
    return t in _SUMS and len(nd.args) == 1 and not nd.kwargs


@dataclass(frozen=True)
class _Chunked:
    """What a rewrite replaces: ``root`` (the concatenation, or the last of the additions), the
    nodes that go with it, the first chunk's ops (its result ``out``) and its chunks -> their splits."""

    root: fx.Node
    how: str
    doomed: frozenset[fx.Node]
    ops: list[fx.Node]
    chunks: dict[fx.Node, fx.Node]
    out: fx.Node
    split: fx.Node  # the first of the splits, for the note
    cut: tuple[fx.Node, fx.Node] | None = None  # the last chunk's cut (``_tail_cut``), the op of ``ops`` it cuts


def _fusable(root: fx.Node, parts: list, sinks: set[fx.Node], how: str, order: dict[fx.Node, int]) -> _Chunked | None:
    """The rewrite of ``parts``, the results of chunks that went through the same ops combined by
    ``sinks`` into ``root``: concatenated along the rows (``how`` "concatenated": every op
    row-local) or added (``how`` "summed": the last op sums what row-local ops made), or None."""
    if len(parts) < 2 or not all(isinstance(p, fx.Node) for p in parts):
        return None
    cones = [_cone(p, i, sinks, order) for i, p in enumerate(parts)]
    if any(c is None for c in cones):
        return None
    (ops0, chunks0), out0 = cones[0], parts[0]
    splits = set(chunks0.values())
    if not chunks0:
        return None
    for s in splits:  # every chunk of every split is read, one per part
        if len([u for u in s.users if u.target is operator.getitem]) != len(parts) or len(s.users) != len(parts):
            return None
    by_split = {s: c for c, s in chunks0.items()}
    # the last chunk may be cut short for a shift, one op more than the others'
    last_ops = cones[-1][0]
    cuts = [nd for nd in last_ops if _target(nd) is operator.getitem] if len(last_ops) == len(ops0) + 1 else []
    cut = cuts[0] if len(cuts) == 1 and len(cuts[0].args[0].users) == 1 else None
    to_first = {}
    for i, (ops, chunks) in enumerate(cones[1:], 1):
        to_first = {c: by_split[s] for c, s in chunks.items()}
        if set(chunks.values()) != splits or not _same_ops(ops0, ops, to_first, cut if i == len(parts) - 1 else None):
            return None
    rows = {c: _split_dim(s) for c, s in chunks0.items()}
    sums = [u for u in root.users if _target(u) in _SUMS and len(u.args) == 1 and not u.kwargs]
    any_order = how == "summed" or len(root.users) == 1 and len(sums) == 1  # only summed: any order of rows
    for nd in ops0:
        if how == "summed" and nd is out0:
            if not _summed(nd, rows):
                return None
            continue
        d = _row_dim(nd, rows, any_order)
        if d is None:
            return None
        rows[nd] = d
    cut_of: dict[fx.Node, int] = {}
    if cut is not None:
        cut_op = to_first.get(cut.args[0])
        k = _tail_cut(cut, {cut.args[0]: rows.get(cut_op)}) if cut_op in rows else None
        from_splits = {chunks0[c] for c in _ancestors(cut_op, chunks0)}
        if k is None or len(from_splits) != 1:
            return None
        cut_of = {from_splits.pop(): k}
    if not _split_alike(splits, cut_of):
        return None
    if how == "concatenated":
        out = _example(out0)
        if out is None or _arg(root, 1, "dim", 0) % out.ndim != rows[out0]:
            return None
    elif out0 not in ops0:
        return None
    doomed = {*sinks, *splits, *(nd for ops, chunks in cones for nd in (*ops, *chunks))}
    first = min(splits, key=order.__getitem__)
    return _Chunked(root, how, frozenset(doomed), ops0, chunks0, out0, first, (cut, cut_op) if cut_of else None)


def _ancestors(nd: fx.Node, chunks: dict[fx.Node, fx.Node]) -> set[fx.Node]:
    """The chunks ``nd`` is computed from."""
    found, todo, seen = set(), [nd], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in chunks:
            found.add(x)
        else:
            todo.extend(x.all_input_nodes)
    return found


def _additions(root: fx.Node) -> tuple[list, set[fx.Node]] | None:
    """(the terms, the additions) of a sum of terms ``root`` ends, a leading 0 dropped (Python's
    ``sum`` and a loop's ``loss = 0`` start there), or None."""
    terms, adds, todo = [], set(), [root]
    while todo:  # left to right, without recursion: a loss over 1000 chunks adds 1000 terms
        nd = todo.pop()
        inner = nd is root or isinstance(nd, fx.Node) and len(nd.users) == 1
        if inner and isinstance(nd, fx.Node) and _target(nd) in _ADDS and len(nd.args) == 2 and not nd.kwargs:
            adds.add(nd)
            todo += [nd.args[1], nd.args[0]]
        else:
            terms.append(nd)
    if terms and isinstance(terms[0], (int, float)) and terms[0] == 0:
        terms = terms[1:]
    return (terms, adds) if len(adds) >= 1 and all(isinstance(t, fx.Node) for t in terms) else None


def _found(gm: fx.GraphModule) -> list[_Chunked]:
    out, taken = [], set()
    order = {nd: i for i, nd in enumerate(gm.graph.nodes)}
    for nd in reversed(gm.graph.nodes):
        if nd in taken or nd.op != "call_function" and nd.op != "call_method":
            continue
        if nd.target in _CATS and nd.args and isinstance(nd.args[0], (list, tuple)):
            found = _fusable(nd, list(nd.args[0]), {nd}, "concatenated", order)
        elif _target(nd) in _ADDS and (summed := _additions(nd)) is not None:
            found = _fusable(nd, summed[0], summed[1], "summed", order)
        else:
            continue
        if found is not None:
            out.append(found)
            taken |= found.doomed
    return out


def _describe(c: _Chunked) -> str:
    names = ", ".join(dict.fromkeys(getattr(_target(nd), "__name__", str(_target(nd))) for nd in c.ops))
    cut = f" (the last cut short at {source_line(c.cut[0])})" if c.cut is not None else ""
    return (
        f"chunked along the sequence at {source_line(c.split)}: {len(c.split.users)} chunks, each through {names}, "
        f"{c.how}{cut}: run as one on the whole tensor (the chunks gather nothing)"
    )


def unchunk(gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """``gm`` with every concatenation (along the rows) or sum of chunks that went through the
    same ops, row-local but for a sum last, replaced by those ops on the unsplit tensors; and a
    note per rewrite."""
    notes = []
    for c in _found(gm):
        env: dict[fx.Node, fx.Node] = {chunk: split.args[0] for chunk, split in c.chunks.items()}
        with gm.graph.inserting_before(c.root):
            for nd in c.ops:
                env[nd] = gm.graph.node_copy(nd, lambda n, env=env: env.get(n, n))
                if c.cut is not None and nd is c.cut[1]:  # the whole cut where the last chunk was
                    whole, src = env[nd], c.cut[0].args[0]
                    env[nd] = gm.graph.node_copy(c.cut[0], lambda n, whole=whole, src=src: whole if n is src else n)
        notes.append(_describe(c))
        c.root.replace_all_uses_with(env[c.out])
        for nd in reversed(list(gm.graph.nodes)):
            if nd in c.doomed and not nd.users:
                gm.graph.erase_node(nd)
    gm.graph.lint()
    gm.recompile()
    return gm, tuple(notes)
