"""FlexAttention's per-rank call (its rules are ``propagate._flex``): the op itself on this rank's
piece, with its score and mask functions and block mask rewritten for it.

The functions see global indices: split over heads (or the batch), a rank's head (or sequence) 0
is global ``h0``; with the query rows sequence-sharded, its row 0 is global row ``start``. Each
function is wrapped to add that offset to its index, the offset passed as one more captured
tensor (a 0-dim int32 tensor: on a symbolic length it is an expression of the length, which the
traced functions cannot close over), so a document, causal or sliding-window mask, or a
relative-position score, sees the global positions of one device. The wrapped backward's joint
function returns no gradient for the offset, and the per-rank call drops that entry.

With the query rows sharded, the block mask is this rank's rows of the global one: its lengths
(rows, all keys), and its block-sparsity tensors the global mask's row blocks where the rank's
first row starts a block (a length that splits over the ranks in multiples of the block size, as
torch's context parallelism requires; the per-query-block tables then follow with
``BlockMask.from_kv_blocks``), else one partial block everywhere (the mask function alone then
decides: exact, without the block sparsity). Split over heads or the batch, the block tensors are
already this rank's (placed by the rule) and the lengths unchanged.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..propagate._flex import (
    BACKWARD_ARGS,
    BLOCK_MASK,
    BLOCK_TABLES,
    FLEX,
    FLEX_BACKWARD,
    FORWARD_ARGS,
    flex_args,
    flex_inputs,
)
from ..propagate._placement import chunk_start, shard_spec

__all__ = ["flex_call", "rows_block_mask", "FLEX_CALLS"]


def _shifted(fn, dim: int, score: bool, joint: bool = False):
    """``fn`` (a score, mask or joint function) with its index along ``dim`` (batch, head or query
    row) offset by its last captured tensor."""
    at = dim + (1 if score else 0)  # a score (and joint) function's first argument is the score

    def shifted(*args):
        *args, offset = args
        args[at] = args[at] + offset
        out = fn(*args)
        return [*out, None] if joint else out  # no gradient for the offset

    return shifted


def rows_block_mask(block: dict, start, rows, mask_mod) -> tuple:
    """``BlockMask.as_tuple()`` of rows ``start .. start + rows`` of the block mask ``block`` (its
    fields by name), against all keys, with ``mask_mod`` (this rank's function)."""
    QB, KB = block["q_block_size"], block["kv_block_size"]
    kv_len = block["kv_len"]
    kv_num = block["kv_num_blocks"]
    first = start // QB
    # this rank's row blocks of the global mask where its first row starts one; a guard on a
    # symbolic length (the ranks then agree: ``rank_graph`` exchanges guards)
    if bool(start % QB == 0):
        end = first + (rows + QB - 1) // QB
        fields = [block[f] for f in BLOCK_TABLES[:4]]  # the kv-side tables; from_kv_blocks derives the rest
        # contiguous, as torch's own are (small: a row block holds one entry per key block)
        num, idx, full_num, full_idx = (None if t is None else t[:, :, first:end].contiguous() for t in fields)
    else:  # one partial block everywhere: the mask function decides every entry
        q_blocks, kv_blocks = (rows + QB - 1) // QB, (kv_len + KB - 1) // KB
        lead = tuple(kv_num.shape[:2])
        num = torch.full((*lead, q_blocks), kv_blocks, dtype=torch.int32, device=kv_num.device)
        idx = torch.arange(kv_blocks, dtype=torch.int32, device=kv_num.device).expand(*lead, q_blocks, kv_blocks)
        num, idx, full_num, full_idx = num, idx.contiguous(), None, None
    mask = BlockMask.from_kv_blocks(
        num, idx, full_num, full_idx, BLOCK_SIZE=(QB, KB), mask_mod=mask_mod, seq_lengths=(rows, kv_len)
    )
    return mask.as_tuple()


def flex_call(nd, s, target, args, kwargs, ctx):
    """(call, args, kwargs) of a FlexAttention op (forward or backward) on this rank's piece."""
    roles = flex_inputs(nd)
    spec = shard_spec(s.ins[roles.index("query")])
    if spec is None:  # whole on every rank
        return target, args, kwargs
    dim = spec[0]
    a = flex_args(target, args)
    q = a["query"]
    global_q = flex_args(nd.target, nd.args)["query"].meta["val"]
    start = chunk_start(global_q.shape[dim], ctx.n, ctx.rank)
    offset = torch.full((), start, dtype=torch.int32, device=q.device)
    mask_mod = _shifted(a["block"]["mask_mod"], dim, score=False)
    if dim == 2:
        block_mask = rows_block_mask(a["block"], start, q.shape[2], mask_mod)
    else:  # the block tensors this rank's heads or sequences (their placement's slice, a view),
        # contiguous: GPU kernels find a row from the head stride alone
        block_mask = tuple(x.contiguous() if isinstance(x, torch.Tensor) else x for x in a["block_mask"][:-1])
        block_mask = (*block_mask, mask_mod)
    assert len(block_mask) == len(BLOCK_MASK)
    scores = (*a["score_mod_other_buffers"], offset)
    masks = (*a["mask_mod_other_buffers"], offset)
    if target is FLEX:
        new = dict(a, score_mod=_shifted(a["score_mod"], dim, score=True), block_mask=block_mask)
        new.update(score_mod_other_buffers=scores, mask_mod_other_buffers=masks)
        return target, tuple(new[n] for n in FORWARD_ARGS), kwargs
    own = len(a["score_mod_other_buffers"])
    new = dict(
        a,
        fw_graph=_shifted(a["fw_graph"], dim, score=True),
        joint_graph=_shifted(a["joint_graph"], dim, score=True, joint=True),
        block_mask=block_mask,
        score_mod_other_buffers=scores,
        mask_mod_other_buffers=masks,
    )

    def backward(*args):
        dq, dk, dv, grads = FLEX_BACKWARD(*args)
        return dq, dk, dv, tuple(grads[:own])  # the offset's (None) dropped

    return backward, tuple(new[n] for n in BACKWARD_ARGS), kwargs


# op -> its per-rank call under every strategy (``_localize``: before the kernels' calls)
FLEX_CALLS = {FLEX: flex_call, FLEX_BACKWARD: flex_call}
