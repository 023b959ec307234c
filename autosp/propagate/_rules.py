"""Sharding rules: for one ATen node, the strategies (output placements, required input
placements) it can run with on the "sp" axis.

Rules are keyed by op overload (``_strategy.RULES``): a rule sees the placements each input can
take (what propagation reached so far) and returns every strategy that is exact. Ops without a
rule fall back to DTensor's own op strategies (``_dtensor``). Our rules exist where DTensor has
none (attention: ``_attention``; the autosp annotation: ``_annotate``) or where its choice loses
exactness or bytes for SP: views that flatten a sharded dim behind another (DTensor yields
``_StridedShard`` that its matmul strategies cannot consume), and matmuls/reductions that must
understand strided shards.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from .._context import Kernel
from .._graph import nbytes, op_args, out_vals, tensor_inputs
from ._dtensor import dtensor_strategies
from ._placement import P, R, can_shard, is_even, shard, shard_spec
from ._placement import shard_specs as _shards
from ._strategy import PROVENANCE, RULES, Sets, Strategy, provenance, rule
from ._strategy import dedup as _dedup

__all__ = ["strategies_for", "VIEW_OPS", "cat_rule", "split_rule", "FILLED_FACTORIES", "selection_read"]

aten = torch.ops.aten


def _val(node: fx.Node, idx: int = 0):
    return out_vals(node)[idx]


def _each_out(node: fx.Node, p) -> tuple:
    """``p`` for every tensor output of ``node`` (None for the others)."""
    return tuple(p if v is not None else None for v in out_vals(node))


# ---------------------------------------------------------------------------------------------
# dim maps: ops whose output dims are input dims moved around (views, transposes, copies)


def _dim_map_rule(
    node: fx.Node, A: Sets, n: int, dim_map: list[int | None], *, linear=True, blocked: Iterable[int] = ()
) -> list[Strategy]:
    """Output dim e comes from input dim ``dim_map[e]`` (None: a new or broadcast dim);
    ``blocked`` input dims cannot stay sharded."""
    inv = {d: e for e, d in enumerate(dim_map) if d is not None}
    blocked = set(blocked)
    res = [Strategy((R,), (R,))]
    if linear and P in A[0]:
        res.append(Strategy((P,), (P,)))
    for d, sf in _shards(A[0]):
        if d in inv and d not in blocked:
            res.append(Strategy((shard(inv[d], sf),), (shard(d, sf),)))
    return _dedup(res)


@rule(
    aten.alias.default,
    aten.detach.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.lift_fresh_copy.default,
    aten.contiguous.default,
)
def _identity(node, A, n):
    return _dim_map_rule(node, A, n, list(range(_val(node).ndim)))


@rule(aten.transpose.int, aten.t.default)
def _transpose(node, A, n):
    nd = _val(node).ndim
    d0, d1 = (node.args[1], node.args[2]) if node.target is aten.transpose.int else (0, 1)
    m = list(range(nd))
    if nd:
        d0, d1 = d0 % nd, d1 % nd
        m[d0], m[d1] = m[d1], m[d0]
    return _dim_map_rule(node, A, n, m)


@rule(aten.permute.default)
def _permute(node, A, n):
    nd = _val(node).ndim
    return _dim_map_rule(node, A, n, [d % nd for d in node.args[1]])


@rule(aten.unsqueeze.default)
def _unsqueeze(node, A, n):
    nd = _val(node).ndim
    d = node.args[1] % nd
    return _dim_map_rule(node, A, n, [None if e == d else (e if e < d else e - 1) for e in range(nd)])


@rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(node, A, n):
    src = _val(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else range(src.ndim)
    dims = {d % max(src.ndim, 1) for d in ([dims] if isinstance(dims, int) else dims)}
    return _dim_map_rule(node, A, n, [d for d in range(src.ndim) if not (d in dims and src.shape[d] == 1)])


@rule(aten.view_as_complex.default)
def _view_as_complex(node, A, n):
    """(..., 2) real -> (...) complex (complex RoPE, as Meta's Llama and torchtitan write it): the
    last dim, real and imaginary parts, is consumed and cannot be sharded."""
    nd = _val(node.args[0]).ndim
    return _dim_map_rule(node, A, n, list(range(nd - 1)), blocked=[nd - 1])


@rule(aten.view_as_real.default)
def _view_as_real(node, A, n):
    """(...) complex -> (..., 2) real: a new last dim."""
    return _dim_map_rule(node, A, n, [*range(_val(node.args[0]).ndim), None])


@rule(aten.expand.default)
def _expand(node, A, n):
    src, out = _val(node.args[0]), _val(node)
    lead = out.ndim - src.ndim
    m = []
    for e in range(out.ndim):
        d = e - lead
        m.append(None if d < 0 or (src.shape[d] == 1 and out.shape[e] != 1) else d)
    return _dim_map_rule(node, A, n, m)


def _view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split a reshape into groups of input dims and output dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(src):
            gi.append(i)
            pi *= src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pj *= dst[j]
            j += 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                gj.append(j)
                pj *= dst[j]
                j += 1
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _locate(sizes: Sequence[int], dims: Sequence[int], stride: int, n: int, block: int | None = None):
    """Within a group of dims, the dim where a shard with outer ``stride`` (elements of the
    flattened group before the split) falls, and its split factor there. An uneven shard
    (``block`` elements split over the ranks, block % n != 0) only survives a view that keeps its
    block whole as one dim: merged with inner dims, its pieces would no longer be a balanced split."""
    prefix = 1
    for d in dims:
        size = sizes[d]
        if size == 1:
            continue
        if prefix <= stride < prefix * size and stride % prefix == 0:
            sf = stride // prefix
            if block is not None:
                return (d, sf) if size % sf == 0 and size // sf == block else None
            return (d, sf) if can_shard(size, sf, n) else None
        prefix *= size
    return None


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(node, A, n):
    src, out = list(_val(node.args[0]).shape), list(_val(node).shape)
    res = [Strategy((R,), (R,))]
    if P in A[0]:
        res.append(Strategy((P,), (P,)))
    if math.prod(src) == 0:
        return res
    for gi, gj in _view_groups(src, out):
        for d, sf in _shards(A[0]):
            if d not in gi:
                continue
            stride = math.prod(src[x] for x in gi if x < d) * sf
            block = None if is_even(src[d], sf, n) else src[d] // sf
            o = _locate(out, gj, stride, n, block)
            i = _locate(src, gi, stride, n, block)
            if o is not None and i == (d, sf):
                res.append(Strategy((shard(*o),), (shard(d, sf),)))
    return _dedup(res)


# ---------------------------------------------------------------------------------------------
# elementwise ops, with broadcasting; linear ones also carry Partial

_LINEAR_ALL = {aten.add.Tensor, aten.sub.Tensor}
_LINEAR_UNARY = {aten.neg.default, aten.mul.Scalar, aten.div.Scalar, aten._to_copy.default}


def _elementwise(node: fx.Node, A: Sets, n: int, *, blocked_out: Iterable[int] = ()) -> list[Strategy]:
    outs = [v for v in out_vals(node) if v is not None]
    out = outs[0]
    k = out.ndim
    blocked = {b % max(k, 1) for b in blocked_out}
    ins = [_val(p, i) for p, i in tensor_inputs(node)]

    def in_dim(t, e):
        d = e - (k - t.ndim)
        return d if d >= 0 and t.shape[d] == out.shape[e] and out.shape[e] != 1 else None

    res = [Strategy(_each_out(node, R), tuple(R for _ in ins))]
    cands = set()
    for j, t in enumerate(ins):
        for d, sf in _shards(A[j]):
            e = d + (k - t.ndim)
            if e >= 0 and in_dim(t, e) == d and e not in blocked:
                cands.add((e, sf))
    for e, sf in sorted(cands):
        req = []
        for t in ins:
            d = in_dim(t, e)
            req.append(shard(d, sf) if d is not None else R)
        res.append(Strategy(_each_out(node, shard(e, sf)), tuple(req)))
    op = node.target
    nt = len(ins)
    if op in _LINEAR_ALL and nt == 2 and all(P in a for a in A):
        res.append(Strategy(_each_out(node, P), (P, P)))
    elif op in _LINEAR_UNARY and nt == 1 and P in A[0]:
        res.append(Strategy(_each_out(node, P), (P,)))
    elif op is aten.mul.Tensor and nt == 2:
        for j in range(2):
            if P in A[j]:
                res.append(Strategy(_each_out(node, P), tuple(P if x == j else R for x in range(2))))
    elif op is aten.div.Tensor and nt >= 1 and P in A[0] and node.args[0] is tensor_inputs(node)[0][0]:
        res.append(Strategy(_each_out(node, P), (P,) + tuple(R for _ in ins[1:])))
    return _dedup(res)


# elementwise ops torch does not tag pointwise (activation gradients: Mamba's softplus, ELU, ...);
# DTensor has no strategy for them either
_UNTAGGED_POINTWISE = {
    aten.softplus_backward.default,
    aten.elu_backward.default,
    aten.leaky_relu_backward.default,
    aten.hardtanh_backward.default,
    aten.mish_backward.default,
    aten.hardswish.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.softshrink_backward.default,
    aten.hardshrink_backward.default,
}


def _is_pointwise(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and (torch.Tag.pointwise in op.tags or op in _UNTAGGED_POINTWISE)


@rule(aten.log_sigmoid_forward.default)
def _log_sigmoid(node, A, n):
    """(output, buffer): elementwise; the buffer is empty on CUDA (replicated, nothing in it)."""
    res = _elementwise(node, A, n)
    if out_vals(node)[1].numel() == 0:
        res = [Strategy((s.outs[0], R), s.ins) for s in res]
    return res


@rule(aten.log_sigmoid_backward.default)
def _log_sigmoid_bwd(node, A, n):
    return _elementwise(node, A, n)


@rule(aten.linalg_solve_triangular.default, aten.tril.default, aten.triu.default)
def _per_matrix(node, A, n):
    """An op per matrix of the last two dims (a triangular solve, a chunked delta rule's
    within-chunk solve; tril and triu, whose DTensor strategy replicates): sharded along any batch
    dim, never along the matrix dims."""
    return _elementwise(node, A, n, blocked_out=[-1, -2])


@rule(aten._softmax.default, aten._log_softmax.default)
def _softmax(node, A, n):
    return _elementwise(node, A, n, blocked_out=[node.args[1]])


@rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_bwd(node, A, n):
    return _elementwise(node, A, n, blocked_out=[node.args[2]])


@rule(aten.glu.default, aten.glu_backward.default)
def _glu(node, A, n):
    """GLU halves ``dim`` (its gradient doubles it back): elementwise along every other dim (DTensor
    has no strategy for either; x-transformers' attention-on-attention gates by it)."""
    dim = node.args[-1] if len(node.args) > (2 if node.target is aten.glu_backward.default else 1) else -1
    return _elementwise(node, A, n, blocked_out=[dim])


@rule(aten.native_dropout.default, aten.native_dropout_backward.default)
def _dropout(node, A, n):
    """Elementwise, never Partial. On a sharded input each rank draws its own shard's mask
    (partition._localize gives each rank its own random stream)."""
    return _elementwise(node, A, n)


@rule(
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.empty_like.default,
    aten.fill.Scalar,
    aten.zero.default,
)
def _like(node, A, n):
    """A tensor of the input's shape, its values not read (``x.fill_(v)`` and ``x.zero_()`` are
    ``fill`` and ``zero`` once functionalized): any placement of the input, the same out; a
    zero fill also stays a partial sum."""
    zero = node.target in (aten.zeros_like.default, aten.zero.default)
    return _dim_map_rule(node, A, n, list(range(_val(node).ndim)), linear=zero)


@rule(aten.fill.Tensor)
def _fill_tensor(node, A, n):
    """``x.fill_(t)`` with a 0-dim ``t``: the input's placement out, ``t`` replicated."""
    kept = _dim_map_rule(node, A, n, list(range(_val(node).ndim)), linear=False)
    return [Strategy(s.outs, (*s.ins, R)) for s in kept]


# ---------------------------------------------------------------------------------------------
# reductions


def _reduce_dims(node: fx.Node) -> tuple[set[int], bool]:
    x = _val(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None or dims == [] or isinstance(dims, torch.dtype):
        dims = list(range(x.ndim))
    if isinstance(dims, int):
        dims = [dims]
    keep = (
        bool(node.args[2])
        if len(node.args) > 2 and isinstance(node.args[2], bool)
        else bool(node.kwargs.get("keepdim", False))
    )
    return {d % max(x.ndim, 1) for d in dims}, keep


def _reduction(node, A, n, *, linear: bool, partial=None):
    """A reduction over some dims: a sharded dim kept stays sharded; one reduced leaves partial
    results, combined by ``P`` (sums, ``linear``) or by ``partial`` (``Partial("max")`` for a
    maximum), else the reduced dim must be whole."""
    dims, keep = _reduce_dims(node)
    res = [Strategy(_each_out(node, R), (R,))]
    if linear and P in A[0]:
        res.append(Strategy(_each_out(node, P), (P,)))
    for d, sf in _shards(A[0]):
        if d in dims:
            if linear or partial is not None:
                res.append(Strategy(_each_out(node, P if linear else partial), (shard(d, sf),)))
        else:
            e = d if keep else d - sum(1 for r in dims if r < d)
            res.append(Strategy(_each_out(node, shard(e, sf)), (shard(d, sf),)))
    return _dedup(res)


@rule(aten.logsumexp.default, aten.var.correction, aten.std.correction, aten.prod.dim_int)
def _merged_reduction(node, A, n):
    """Whole along the reduced dims, or split along them, each rank's result for its own
    elements gathered (reduced-sized) and merged (``partition._merge``): log-sum-exps by a
    log-sum-exp over the ranks, products by a product, variances by Chan's formula from each
    rank's (count, mean, sum of squared deviations)."""
    dims, _ = _reduce_dims(node)
    res = _reduction(node, A, n, linear=False)
    sent = nbytes(_val(node)) * (n - 1) * (3 if node.target in (aten.var.correction, aten.std.correction) else 1)
    for d, sf in _shards(A[0]):
        if d in dims and _val(node.args[0]).is_floating_point():
            res.append(Strategy((R,), (shard(d, sf),), kernel=Kernel.MERGE, comm=sent))
    return _dedup(res)


@rule(aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default)
def _scan(node, A, n):
    """A running sum (product, log-sum-exp) along a dim: sharded along any other dim; or along
    it, each rank scanning its own rows and combining them with what the ranks before it total (their last rows,
    gathered: reduced-sized; ``partition._merge``). Floating-point data only: integer and bool
    scans (positions from a mask) are bookkeeping, replicated cheaply."""
    x, out = _val(node.args[0]), _val(node)
    dim = node.args[1] % max(x.ndim, 1)
    res = _dim_map_rule(node, A, n, list(range(x.ndim)), linear=node.target is aten.cumsum.default, blocked=[dim])
    if out.is_floating_point():
        sent = nbytes(out) / max(out.shape[dim], 1) * (n - 1)  # a row from every other rank
        res += [
            Strategy((shard(d),), (shard(d),), kernel=Kernel.MERGE, comm=sent)
            for d, sf in _shards(A[0])
            if d == dim and sf == 1
        ]
    return _dedup(res)


@rule(aten.sum.dim_IntList, aten.sum.default)
def _sum(node, A, n):
    return _reduction(node, A, n, linear=True)


@rule(aten.amax.default, aten.amin.default)
def _extremum(node, A, n):
    """The largest (smallest) element: each rank's over its shard, then all-reduced MAX (MIN).
    (``max.dim`` also returns the index, which no all-reduce combines: it reads the dim whole.)"""
    return _reduction(node, A, n, linear=False, partial=Partial("max" if node.target is aten.amax.default else "min"))


@rule(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def _extremum_at(node, A, n):
    """The largest (smallest) element along one dim and where it lies: whole along the dim, or
    split along it, each rank's (value, global index) for its own rows gathered (reduced-sized)
    and merged (``partition._merge``), the first index winning ties as on one device. Their
    gradient scatters into the winning row, on the rank that holds it (``_scatter``)."""
    res = _reduction(node, A, n, linear=False)
    if len(node.args) < 2 or node.args[1] is None or not _val(node.args[0]).is_floating_point():
        return res  # an argmax of every element indexes the flattened tensor: read whole
    x, idx = _val(node.args[0]), out_vals(node)[-1]
    d = node.args[1] % max(x.ndim, 1)
    sent = idx.numel() * (idx.element_size() + x.element_size()) * (n - 1)  # (value, index) pairs
    for e, sf in _shards(A[0]):
        if e == d:
            res.append(Strategy(_each_out(node, R), (shard(d, sf),), kernel=Kernel.MERGE, comm=sent))
    return _dedup(res)


@rule(
    aten.any.dim,
    aten.all.dim,
)
def _reduce_nonlinear(node, A, n):
    return _reduction(node, A, n, linear=False)


@rule(aten.native_layer_norm.default)
def _layer_norm(node, A, n):
    x = _val(node.args[0])
    nd = len(node.args[1])
    rest = tuple(R for _ in tensor_inputs(node)[1:])
    res = [Strategy((R, R, R), (R,) + rest)]
    for d, sf in _shards(A[0]):
        if d < x.ndim - nd:
            p = shard(d, sf)
            res.append(Strategy((p, p, p), (p,) + rest))
    return res


@rule(aten.native_layer_norm_backward.default)
def _layer_norm_bwd(node, A, n):
    x = _val(node.args[1])
    nd = len(node.args[2])
    outs = out_vals(node)
    ti = tensor_inputs(node)
    res = [Strategy(tuple(R if v is not None else None for v in outs), tuple(R for _ in ti))]
    for d, sf in _shards(A[0]):
        if d < x.ndim - nd:
            p = shard(d, sf)
            ins = tuple(p if j in (0, 1, 2, 3) else R for j in range(len(ti)))  # grad, x, mean, rstd
            o = tuple(None if v is None else (p if j == 0 else P) for j, v in enumerate(outs))
            res.append(Strategy(o, ins))
    return res


# ---------------------------------------------------------------------------------------------
# contractions, as einsums over dim labels


def _einsum(node, A, n, in_labels: list[str], out_labels: str, *, partial_ok=True) -> list[Strategy]:
    res = [Strategy((R,), tuple(R for _ in in_labels))]
    cands = set()
    for j, labels in enumerate(in_labels):
        for d, sf in _shards(A[j]):
            cands.add((labels[d], sf))
    for lab, sf in sorted(cands):
        req = tuple(shard(labels.index(lab), sf) if lab in labels else R for labels in in_labels)
        if lab in out_labels:
            res.append(Strategy((shard(out_labels.index(lab), sf),), req))
        elif partial_ok:
            res.append(Strategy((P,), req))
    if partial_ok:
        for j in range(len(in_labels)):
            if P in A[j]:
                res.append(Strategy((P,), tuple(P if x == j else R for x in range(len(in_labels)))))
    return _dedup(res)


@rule(aten.mm.default)
def _mm(node, A, n):
    return _einsum(node, A, n, ["mk", "kn"], "mn")


@rule(aten.bmm.default)
def _bmm(node, A, n):
    strats = _einsum(node, A, n, ["bmk", "bkn"], "bmn")
    # A batched matmul's batch dim is always parallel: when its operands are sharded along
    # conflicting dims (attention: q along rows, k along columns), re-sharding both on the batch
    # (heads) is an exact way out. The split factor is unknown here (batch x heads flattened), so
    # offer each one; the solver picks by bytes.
    batch = _val(node).shape[0]
    for sf in range(1, batch + 1):
        # uneven blocks too (6 heads over 4 ranks: 2, 2, 1, 1), but no block shorter than n
        if batch % sf == 0 and batch // sf >= n:
            p = shard(0, sf)
            strats.append(Strategy((p,), (p, p), introduces=True))
    return _dedup(strats)


@rule(aten.addmm.default)
def _addmm(node, A, n):
    bias = _val(node.args[0])
    bl = "mn"[2 - bias.ndim :] if bias.ndim else ""
    strats = _einsum(node, A, n, [bl, "mk", "kn"], "mn", partial_ok=False)
    out = []
    for s in strats:  # a broadcast bias dim (size 1) stays replicated
        if bias.ndim and shard_spec(s.ins[0]) and bias.shape[shard_spec(s.ins[0])[0]] == 1:
            s = Strategy(s.outs, (R,) + s.ins[1:])
        out.append(s)
    return out


# ---------------------------------------------------------------------------------------------
# indexing


@rule(aten.embedding.default)
def _embedding(node, A, n):
    out = _val(node)
    res = [Strategy((R,), (R, R))]
    for d, sf in _shards(A[1]):
        res.append(Strategy((shard(d, sf),), (R, shard(d, sf))))
    for d, sf in _shards(A[0]):
        if d == 1:
            res.append(Strategy((shard(out.ndim - 1, sf),), (shard(1, sf), R)))
    return _dedup(res)


@rule(aten.embedding_dense_backward.default)
def _embedding_bwd(node, A, n):
    grad = _val(node.args[0])
    res = [Strategy((R,), (R, R))]
    # token dims: sharded alike in the gradient and the indices (a replicated index tensor, e.g.
    # positions from arange, is sliced for free) give a partial sum of the table's gradient
    for d, sf in sorted(set(_shards(A[1])) | {(d, sf) for d, sf in _shards(A[0]) if d < grad.ndim - 1}):
        res.append(Strategy((P,), (shard(d, sf), shard(d, sf))))
    for d, sf in _shards(A[0]):
        if d == grad.ndim - 1:
            res.append(Strategy((shard(1, sf),), (shard(d, sf), R)))
    return _dedup(res)


@rule(aten.gather.default)
def _gather(node, A, n):
    dim = node.args[1] % _val(node).ndim
    res = [Strategy((R,), (R, R))]
    for j in (0, 1):
        for d, sf in _shards(A[j]):
            if d != dim:
                res.append(Strategy((shard(d, sf),), (shard(d, sf), shard(d, sf))))
    return _dedup(res)


@rule(aten.scatter.value, aten.scatter.src, aten.scatter_add.default)
def _scatter(node, A, n):
    """Along another dim, everything sharded alike. Along the sharded dim itself, with the index
    (global rows) and source whole: each rank writes the entries that land in its own rows
    (``partition._scatter``), e.g. ``max(dim)``'s gradient into the winning row."""
    dim = node.args[1] % _val(node).ndim
    k = len(tensor_inputs(node))
    res = [Strategy((R,), tuple(R for _ in range(k)))]
    for j in range(k):
        for d, sf in _shards(A[j]):
            if d != dim:
                p = shard(d, sf)
                res.append(Strategy((p,), tuple(p for _ in range(k))))
    # a selection's gradient (max(dim)'s) goes back into the rows the selection read, laid out as
    # they were (propagation offers that layout), though nothing sharded reaches its zeros
    selection = k == 3 and selection_read(node) is not None
    for d, sf in _shards(A[0]):
        if d == dim:
            p = shard(d, sf)
            res.append(Strategy((p,), (p,) + (R,) * (k - 1), kernel=Kernel.OWN_ROWS, introduces=selection))
    return _dedup(res)


@rule(aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable)
def _along_dim(node, A, n):
    """An ordering or a top-k along one dim (a router's experts for each token): sharded along any
    other dim, strided shards of a flattened batch included (DTensor's strategies have none);
    never along its own, which it reads whole."""
    return _elementwise(node, A, n, blocked_out=[op_args(node)["dim"]])


_SELECTIONS = (aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
_INDEX_VIEWS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default)


def selection_read(node: fx.Node) -> tuple[fx.Node, int] | None:
    """For a scatter of a selection's gradient (``max(x, dim)``'s: into zeros like ``x``, at the
    indices the selection found along ``dim``), the selection's input ``x``; else None."""
    if node.target not in (aten.scatter.src, aten.scatter_add.default, aten.scatter.value):
        return None
    dim, index, shape = node.args[1] % _val(node).ndim, node.args[2], _val(node).shape
    while isinstance(index, fx.Node) and index.target in (*_INDEX_VIEWS, operator.getitem):
        index = index.args[0]
    if not isinstance(index, fx.Node) or index.target not in _SELECTIONS or len(index.args) < 2:
        return None
    x = _val(index.args[0])
    if tuple(x.shape) != tuple(shape) or index.args[1] is None or index.args[1] % x.ndim != dim:
        return None
    return tensor_inputs(index)[0]


@rule(aten.select.int)
def _select(node, A, n):
    nd = _val(node.args[0]).ndim
    dim = node.args[1] % nd
    return _dim_map_rule(node, A, n, [d for d in range(nd) if d != dim], blocked=[dim])


@rule(aten.select_backward.default)
def _select_bwd(node, A, n):
    sizes, dim = node.args[1], node.args[2] % len(node.args[1])
    return _dim_map_rule(node, A, n, [None if e == dim else (e if e < dim else e - 1) for e in range(len(sizes))])


@rule(aten.select_scatter.default)
def _select_scatter(node, A, n):
    """``select_scatter(x, src, dim, index)``: ``x`` with ``src`` written at ``index`` along ``dim``
    (a chunked scan writing one chunk at a time: Qwen3-Next's gated delta rule, heads sharded).
    Sharded alike along any other dim (``src`` has no ``dim``), or partial sums alike (the result
    is linear in the two together); along ``dim`` itself, whole."""
    nd = _val(node).ndim
    dim = op_args(node)["dim"] % nd
    res = [Strategy((R,), (R, R))]
    if P in A[0] and P in A[1]:
        res.append(Strategy((P,), (P, P)))
    dims = {(d, sf) for d, sf in _shards(A[0]) if d != dim} | {(e + (e >= dim), sf) for e, sf in _shards(A[1])}
    for d, sf in sorted(dims, key=str):
        res.append(Strategy((shard(d, sf),), (shard(d, sf), shard(d - (d > dim), sf))))
    return _dedup(res)


@rule(aten.slice_scatter.default)
def _slice_scatter(node, A, n):
    """``slice_scatter(x, src, dim, start, end, step)``: ``x`` with ``src`` written into a slice
    along ``dim``; an indexed write under Dynamo (``out[:, :, i] = v``) writes through a slice of
    every dim before the indexed one, the whole of it. Sharded alike along any other dim, and
    along ``dim`` itself where the slice is all of it (``src`` is then the result); partial sums
    alike (linear in the two together)."""
    x, src = _val(node.args[0]), _val(node.args[1])
    dim = op_args(node)["dim"] % x.ndim
    whole = all(statically_known_true(a == b) for a, b in zip(x.shape, src.shape))
    res = [Strategy((R,), (R, R))]
    if P in A[0] and P in A[1]:
        res.append(Strategy((P,), (P, P)))
    for d, sf in sorted(set(_shards(A[0])) | set(_shards(A[1])), key=str):
        if d != dim or whole:
            res.append(Strategy((shard(d, sf),), (shard(d, sf), shard(d, sf))))
    return _dedup(res)


@rule(aten.cat.default)
def _cat(node, A, n):
    out = _val(node)
    dim = (node.args[1] if len(node.args) > 1 else 0) % out.ndim
    vals = [_val(u, i) for u, i in tensor_inputs(node)]
    k = len(vals)
    nonempty = [j for j, v in enumerate(vals) if v.numel() > 0]
    if len(nonempty) == 1:  # e.g. a KV cache's first update: cat([empty, x]) is x, any dim
        j = nonempty[0]
        # the empty inputs take the same placement (a free slice of nothing), so that their other
        # dims match x's local ones (partial rotary: cat([rotated, pass_through[..., :0]], -1))
        return [
            Strategy((p,), tuple(p if vals[x].ndim == out.ndim else R for x in range(k)))
            for p in [R] + sorted((q for q in A[j] if q != R), key=str)
            if vals[j].ndim == out.ndim
        ]
    res = [Strategy((R,), tuple(R for _ in range(k)))]
    if all(P in a for a in A):
        res.append(Strategy((P,), tuple(P for _ in range(k))))
    for a in A:
        for d, sf in _shards(a):
            if d != dim:
                p = shard(d, sf)
                res.append(Strategy((p,), tuple(p for _ in range(k))))
    return _dedup(res)


cat_rule = _cat  # extended by ``_shift`` with cats along the sharded dim


@rule(aten.stack.default)
def _stack(node, A, n):
    """stack inserts a new dim: a shard of the inputs' dim d is the output's d (d < dim) or d + 1."""
    out = _val(node)
    dim = (node.args[1] if len(node.args) > 1 else 0) % out.ndim
    k = len(tensor_inputs(node))
    res = [Strategy((R,), tuple(R for _ in range(k)))]
    if all(P in a for a in A):
        res.append(Strategy((P,), tuple(P for _ in range(k))))
    for a in A:
        for d, sf in _shards(a):
            res.append(Strategy((shard(d if d < dim else d + 1, sf),), tuple(shard(d, sf) for _ in range(k))))
    return _dedup(res)


@rule(aten.copy.default)
def _copy(node, A, n):
    """copy(dst, src): src's values in dst's shape (functionalized in-place ops, e.g. ``x /= c``);
    dst's values are overwritten, so it only has to be laid out like the result."""
    dst, src = _val(node.args[0]), _val(node.args[1])
    res = [Strategy((R,), (R, R))]
    if dst.shape != src.shape:
        return res
    for d, sf in _shards(A[1]):
        p = shard(d, sf)
        res.append(Strategy((p,), (p, p)))
    if P in A[1]:
        res.append(Strategy((P,), (R, P)))
    return _dedup(res)


@rule(aten.unbind.int)
def split_rule(node, A, n):
    """A split or unbind: every output as the input along any dim it does not split (a split
    along the sequence: ``propagate._shift``)."""
    x = _val(node.args[0])
    unbind = node.target is aten.unbind.int
    dim = (
        (node.args[1] if unbind else (node.args[2] if len(node.args) > 2 else 0))
        if len(node.args) > 1 or not unbind
        else 0
    )
    dim %= x.ndim
    k = len(out_vals(node))
    res = [
        Strategy(tuple(R for _ in range(k)), (R,)),
    ]
    if P in A[0]:
        res.append(Strategy(tuple(P for _ in range(k)), (P,)))
    for d, sf in _shards(A[0]):
        if d != dim:
            e = d - 1 if unbind and d > dim else d
            res.append(Strategy(tuple(shard(e, sf) for _ in range(k)), (shard(d, sf),)))
    return _dedup(res)


@rule(operator.getitem)
def _getitem(node, A, n):
    return [Strategy((p,), (p,)) for p in sorted(A[0], key=str)]


# ---------------------------------------------------------------------------------------------
# factories: computed whole on every rank (cheap, sequence-sized at most), sliced where needed


@rule(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty.default,
    aten.empty_strided.default,
    aten.lift_fresh.default,
    aten.new_empty_strided.default,
)
def _factory(node, A, n):
    """A factory's tensor argument (``x.new_zeros(size)``) gives only dtype and device: it stays
    wherever it is, never gathered for this. (One of ``FILLED_FACTORIES`` is also made sharded
    where a later op asks for it so: ``propagate._propagate``.)"""
    ins = tensor_inputs(node)
    if len(ins) == 1 and node.target is not aten.lift_fresh.default:
        return [Strategy((R,), (p,)) for p in sorted(A[0], key=str)]
    return [Strategy((R,), tuple(R for _ in ins))]


# factories of one value everywhere (made in a sharded layout in its local shape,
# ``partition._localize``, rather than whole and sliced), and where their size argument is
FILLED_FACTORIES = {
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.full.default: 0,
    aten.empty.memory_format: 0,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_full.default: 1,
    aten.new_empty.default: 1,
}


# a softmax over the key positions still carries them (hand-written attention)
provenance(
    aten._softmax.default,
    aten._log_softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
)(_elementwise)


def strategies_for(node: fx.Node, A: Sets, n: int, mesh=None, provenance: bool = False) -> list[Strategy] | None:
    """All exact strategies for ``node`` given the placements its inputs can take; None when no
    rule (ours or DTensor's) knows the op. With ``provenance``, also correspondences that are not
    executable (attention: query sequence in, query sequence out), for tracking the sequence.

    A dim of data-dependent size (a count ``nonzero`` made) is never sharded, in or out: how it
    splits over the ranks is not known before the data, and no collective here moves it."""
    op = node.target
    outs, ins = out_vals(node), [out_vals(u)[i] for u, i in tensor_inputs(node)]
    counts = any(v is not None and free_unbacked_symbols(v.shape) for v in (*outs, *ins))
    if counts:
        A = [frozenset(p for p in a if not _shards_count(p, v)) for a, v in zip(A, ins)]
    if provenance and op in PROVENANCE:
        found = PROVENANCE[op](node, A, n)
    elif op in RULES:
        found = RULES[op](node, A, n)
    elif _is_pointwise(op):
        found = _elementwise(node, A, n)
    else:
        found = dtensor_strategies(node, A, n, mesh)
    if not counts or not found:
        return found
    kept = [s for s in found if not any(map(_shards_count, s.outs, outs)) and not any(map(_shards_count, s.ins, ins))]
    return kept or None


def _shards_count(p, v) -> bool:
    spec = shard_spec(p) if p is not None else None
    return spec is not None and v is not None and bool(free_unbacked_symbols(v.shape[spec[0]]))


VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.view_as_complex.default,
    aten.view_as_real.default,
    aten.alias.default,
    aten.detach.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    operator.getitem,
}
