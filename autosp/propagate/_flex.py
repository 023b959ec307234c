"""FlexAttention's sharding rules: the ``flex_attention`` higher-order op (what
``torch.nn.attention.flex_attention.flex_attention`` traces to, torchtitan's attention) and its
backward. Its per-rank call, which rewrites the block mask and the score and mask functions for
this rank's piece, is ``partition._flex``.

A FlexAttention op runs with its heads split (Ulysses), its batch split, or with the query rows
sequence-sharded against all-gathered K/V (as torch's context parallelism runs it): each rank
evaluates the mask and score functions on its own rows only (their query index offset by its
first row), so no rank holds an L x L mask. Its block mask, captured functions' tensors and
block-sparsity tensors (``(L / 128)^2`` integers) stay whole. Not offered: ring attention.
Refused (a ``PlanError``): a score function that reads a tensor taking a gradient (a learned
bias), whose gradient the op returns in a tuple of its own, which autosp does not place.

A higher-order op has no schema: its arguments are read by position through ``FORWARD_ARGS``,
``BACKWARD_ARGS`` and ``BLOCK_MASK`` (``BlockMask.as_tuple()``'s fields), in one place.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._context import Kernel
from .._graph import out_vals
from ..errors import PlanError, source_line
from ._placement import P, R, shard, shard_specs
from ._strategy import Strategy, provenance, rule

__all__ = [
    "FLEX",
    "FLEX_BACKWARD",
    "FORWARD_ARGS",
    "BACKWARD_ARGS",
    "BLOCK_MASK",
    "BLOCK_TABLES",
    "DQ_ORDERS",
    "is_flex",
    "flex_args",
    "flex_inputs",
    "flex_note",
]

FLEX = torch.ops.higher_order.flex_attention
FLEX_BACKWARD = torch.ops.higher_order.flex_attention_backward

# the higher-order ops' arguments, by position (torch 2.13's ``flex_attention`` and
# ``flex_attention_backward``)
FORWARD_ARGS = (
    "query",
    "key",
    "value",
    "score_mod",
    "block_mask",
    "scale",
    "kernel_options",
    "score_mod_other_buffers",
    "mask_mod_other_buffers",
)
BACKWARD_ARGS = (
    "query",
    "key",
    "value",
    "out",
    "logsumexp",
    "grad_out",
    "grad_logsumexp",
    "fw_graph",
    "joint_graph",
    "block_mask",
    "scale",
    "kernel_options",
    "score_mod_other_buffers",
    "mask_mod_other_buffers",
)
# ``BlockMask.as_tuple()``: its lengths, block-sparsity tensors, block sizes and mask function
BLOCK_MASK = (
    "q_len",
    "kv_len",
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
    "dq_write_order",
    "dq_write_order_full",
    "dq_kv_order",
    "dq_kv_order_spt",
    "q_block_size",
    "kv_block_size",
    "mask_mod",
)
# its block-sparsity tables, and the deterministic dQ orders that may follow them
BLOCK_TABLES = BLOCK_MASK[2:10]
DQ_ORDERS = BLOCK_MASK[10:14]
# the tensors split alike with the query (and those a backward reads beside it)
_ROWS = ("query", "out", "logsumexp", "grad_out", "grad_logsumexp")


def is_flex(target) -> bool:
    return target is FLEX or target is FLEX_BACKWARD


def flex_args(target, args) -> dict:
    """A FlexAttention op's arguments by name (the block mask as a dict of its fields too:
    ``block_mask`` stays the tuple, ``block`` the dict)."""
    names = FORWARD_ARGS if target is FLEX else BACKWARD_ARGS
    a = dict(zip(names, args))
    a["block"] = dict(zip(BLOCK_MASK, a["block_mask"]))
    return a


def flex_inputs(node: fx.Node) -> list[str]:
    """The role of each tensor input of a FlexAttention node, in ``tensor_inputs`` order: an
    argument's name, a block-mask field's, or ``score_buffer`` / ``mask_buffer`` for the tensors
    the score and mask functions capture."""

    def tensor(a) -> bool:
        return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)

    roles = []
    for name, a in flex_args(node.target, node.args).items():
        if name == "block":
            continue
        if name == "block_mask":
            roles += [field for field, x in zip(BLOCK_MASK, a) if tensor(x)]
        elif name in ("score_mod_other_buffers", "mask_mod_other_buffers"):
            roles += [name.split("_")[0] + "_buffer" for x in a if tensor(x)]
        elif tensor(a):
            roles.append(name)
    return roles


def _val(node: fx.Node, name: str):
    return out_vals(flex_args(node.target, node.args)[name])[0]


def _learned(node: fx.Node) -> bool:
    """Whether the score function reads a tensor that takes a gradient (a learned bias): a
    FlexAttention backward of the graph returns a gradient, used, for one of its captured tensors."""
    mine = set(flex_args(node.target, node.args)["score_mod_other_buffers"])
    for bwd in node.graph.find_nodes(op="call_function", target=FLEX_BACKWARD):
        bufs = flex_args(bwd.target, bwd.args)["score_mod_other_buffers"]
        for grads in (u for u in bwd.users if u.target is operator.getitem and u.args[1] == 3):
            if any(g.target is operator.getitem and g.users and bufs[g.args[1]] in mine for g in grads.users):
                return True
    return False


def _ordered(node: fx.Node) -> bool:
    """A block mask with deterministic dQ write orders (``dq_write_order`` and the fields after
    it): per row block, not re-derived for a rank's rows here."""
    block = flex_args(node.target, node.args)["block"]
    return any(block.get(f) is not None for f in DQ_ORDERS)


def _outs(node: fx.Node, p, grads=None) -> tuple:
    """Output placements: the forward's (out, logsumexp, max) ``p``; the backward's (grad q,
    grad k, grad v) ``grads`` (``p`` each by default) and no placement for its tuple of the
    captured tensors' gradients."""
    if node.target is FLEX:
        return tuple(p if v is not None else None for v in out_vals(node))
    return (*(grads or (p, p, p)), None)


def _ins(node: fx.Node, placed: dict, block=R) -> tuple:
    """Input placements in ``tensor_inputs`` order: ``placed`` by role, block-sparsity tensors
    ``block``, the captured tensors replicated."""
    out = []
    for role in flex_inputs(node):
        if role in placed:
            out.append(placed[role])
        elif role in BLOCK_MASK:
            out.append(block)
        else:
            out.append(R)
    return tuple(out)


def _split(node: fx.Node, dim: int, n: int) -> Strategy | None:
    """The heads (dim 1: Ulysses) or the batch (dim 0) split over the ranks: the block mask's
    tensors split alike where they have one entry per head (or sequence), else stay whole (one
    for all); the functions see global head (or batch) indices (``partition._flex``)."""
    q, k = _val(node, "query"), _val(node, "key")
    if q.shape[dim] % n or k.shape[dim] % n:  # evenly (a rank without heads: the kernels divide by them)
        return None
    if dim == 0 and k.shape[0] != q.shape[0]:
        return None
    args = flex_args(node.target, node.args)
    dims = {out_vals(x)[0].shape[dim] for f, x in args["block"].items() if f in BLOCK_TABLES and x is not None}
    if not dims <= {1, q.shape[dim]}:
        return None
    block = shard(dim) if q.shape[dim] in dims and q.shape[dim] > 1 else R
    s = shard(dim)
    roles = set(flex_inputs(node)) & {*_ROWS, "key", "value"}
    return Strategy(
        _outs(node, s),
        _ins(node, dict.fromkeys(roles, s), block),
        introduces=dim == 1,
        kernel=Kernel.ULYSSES if dim == 1 else Kernel.BATCH,
    )


def _gathered(node: fx.Node, n: int) -> Strategy:
    """The query rows sequence-sharded, K/V all-gathered (their gradients partial sums over the
    ranks' rows): the block mask's and the functions' tensors whole, each rank's rows of the mask
    evaluated by it alone."""
    s2 = shard(2)
    rows = dict.fromkeys(set(flex_inputs(node)) & set(_ROWS), s2)
    placed = {**rows, "key": R, "value": R}
    if node.target is FLEX_BACKWARD:
        return Strategy(_outs(node, s2, (s2, P, P)), _ins(node, placed), kernel=Kernel.KV_GATHER)
    k, v = _val(node, "key"), _val(node, "value")
    kv = (k.numel() + v.numel()) * k.element_size()
    return Strategy(_outs(node, s2), _ins(node, placed), kernel=Kernel.KV_GATHER, held=kv * (n - 1) / n)


@rule(FLEX, FLEX_BACKWARD)
def _flex(node: fx.Node, A, n: int) -> list[Strategy]:
    roles = flex_inputs(node)
    if _learned(node):
        raise PlanError(
            node,
            "FlexAttention's score function reads a tensor that requires grad (a learned bias): its gradient "
            "comes back from the op as a tuple of its own, which autosp does not place",
            "compute the score from tensors that need no gradient (ALiBi's slopes as a buffer), or run this "
            "attention as SDPA with the bias as attn_mask",
        )
    res = [Strategy(_outs(node, R), _ins(node, {}))]
    if shard(2) in A[roles.index("query")] and not _ordered(node):
        res.append(_gathered(node, n))
    for dim in (1, 0):
        if dim == 0 and not any(shard(0) in A[roles.index(a)] for a in ("query", "key", "value")):
            continue
        s = _split(node, dim, n)
        if s is not None:
            res.append(s)
    return res


@provenance(FLEX, FLEX_BACKWARD)
def _flex_seq(node: fx.Node, A, n: int) -> list[Strategy]:
    """FlexAttention's sequence correspondence: the query's sequence dim is the output's and the
    log-sum-exp's; the gradients' are the inputs'."""
    roles = flex_inputs(node)
    res = []
    for d, sf in shard_specs(A[roles.index("query")]):
        if d == 2:
            p = shard(2, sf)
            rows = dict.fromkeys(set(roles) & {*_ROWS, "key", "value"}, p)
            res.append(Strategy(_outs(node, p), _ins(node, rows)))
    return res


def flex_note(nd: fx.Node, s: Strategy, n: int) -> str | None:
    """How a FlexAttention forward runs, for ``explain``."""
    q, k = _val(nd, "query"), _val(nd, "key")
    where = f"FlexAttention at {source_line(nd)} ({q.shape[1]} query / {k.shape[1]} K/V heads)"
    if s.kernel == Kernel.KV_GATHER:
        return (
            f"{where}: the query stays sequence-sharded and K/V are all-gathered (their gradients "
            "reduce-scattered); each rank evaluates the block mask's function on its own query rows"
        )
    if s.kernel == Kernel.BATCH:
        return f"{where}: split over the batch ({q.shape[0]} sequences)"
    if s.kernel == Kernel.ULYSSES:
        return None
    return (
        f"{where}: runs whole on every rank (its heads do not split over sp={n} and its query is not "
        "sequence-sharded): see the all-gathers above"
    )
