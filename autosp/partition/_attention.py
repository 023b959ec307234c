"""Attention kernels with the query sequence-sharded, for heads that cannot be split over the
ranks, and the per-rank calls of the attention ops the plan runs that way (``SEQUENCE_KERNELS``).
Their rules, the ring's schedule and what each sends are in ``propagate._attention``.

Three per-rank kernels, all exact. The first runs against gathered K/V (the plan all-gathers them):

A rank holds query rows ``start .. start + Sq`` of the global sequence and all of K and V. With
a causal mask its rows see every key before ``start`` and a causal diagonal block at
``start .. start + Sq``; keys after that are masked for all of them. Each part runs as the CPU
flash kernel and the parts are merged by their log-sum-exps. The backward runs the kernel's
backward per part with the merged output and log-sum-exp (the blockwise gradient of ring
attention: exact, each part's probabilities are the global softmax restricted to its keys); the
K/V gradients are this rank's partial sums, reduced over the ranks by the plan.

The second is ring attention: each rank keeps its own K/V chunk and the chunks travel around the
ring (one ``all_to_all_single`` to the next rank per step, issued before the step's compute so that
it overlaps), so no rank ever holds more than two chunks. The backward passes the K/V chunks the
same way and their gradient accumulators behind them, home after n steps. Under a causal mask the
queries are first moved to a zigzag (rank r runs query half-chunks r and 2n - 1 - r, an early one
and a late one), so every rank computes about the same number of blocks; the outputs go back to
the contiguous layout the rest of the plan uses. A mask tensor (padding, documents) is read
by its rows where it has one per query (each rank holds its queries' rows; else whole), each block
its rows and columns; the zigzag is for the causal flag only.

The third, on a 2D sp mesh, is hybrid: all-to-alls within each sub-group of u ranks (Ulysses)
give each rank H / u heads of the sub-group's sequence, ring attention runs across the sub-groups
on those heads, and all-to-alls turn the result back.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard
from torch.fx.operator_schemas import normalize_function

from .._attention_ops import BY_NAME, CPU_FLASH, attention_op, input_names
from .._context import Kernel
from .._graph import ATTENTION_OPS, op_args, out_vals
from ..propagate._attention import acc_dtype, blocks, halves, kv_sends, zigzag, zigzag_owner
from ..propagate._attention import bounds as chunk_bounds
from ..propagate._attention import ranges as query_ranges
from ..propagate._placement import chunk_start, is_shard
from ._collectives import redistribute

__all__ = [
    "kv_gathered_attention",
    "kv_gathered_attention_backward",
    "ring_attention",
    "ring_attention_backward",
    "hybrid_attention",
    "hybrid_attention_backward",
    "ring_attention_op",
    "ring_attention_backward_op",
    "RING",
    "RING_BACKWARD",
    "SEQUENCE_KERNELS",
]


def kv_gathered_attention(
    q, k, v, start: int, is_causal: bool, scale=None, attn_mask=None, mask_start: int = 0, kernel: str = CPU_FLASH.name
):
    """(out, logsumexp) of the attention ``kernel`` (``_attention_ops.BY_NAME``) for query rows
    ``start ..`` of the sequence, with K and V whole (and the mask, if any, holding rows from
    ``mask_start``: 0 whole, ``start`` this rank's rows)."""
    run = BY_NAME[kernel].run
    sq = q.shape[2]
    if sq == 0:  # a rank without tokens (the kernel divides by the row count)
        return q.new_zeros(q.shape[:3] + v.shape[3:]), q.new_zeros(
            q.shape[:3], dtype=torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
        )
    if attn_mask is not None:
        mask = _rows(attn_mask, start - mask_start, start - mask_start + sq)
        return run(q, k, v, False, mask, scale)
    outs = [
        run(q, k[:, :, a:b], v[:, :, a:b], c, None, scale)
        for a, b, c in blocks(start, start + sq, 0, k.shape[2], is_causal)
    ]
    if len(outs) == 1:
        return outs[0]
    lse = torch.logaddexp(outs[0][1], outs[1][1])
    # merged in fp32 (the kernel accumulates in fp32 too), rounded once
    out = sum(o.float() * torch.exp(s - lse).unsqueeze(-1).float() for o, s in outs)
    return out.to(q.dtype), lse


def kv_gathered_attention_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    start: int,
    is_causal: bool,
    scale=None,
    attn_mask=None,
    mask_start: int = 0,
    kernel: str = CPU_FLASH.name,
):
    """(grad q, grad k, grad v): grad q for this rank's rows, grad k and v partial (this rank's
    rows' contribution to every key)."""
    run_backward = BY_NAME[kernel].run_backward
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq = torch.zeros_like(q)
    if q.shape[2] == 0:
        return dq, dk, dv
    if attn_mask is not None:
        mask = _rows(attn_mask, start - mask_start, start - mask_start + q.shape[2])
        return tuple(run_backward(grad_out, q, k, v, out, lse, False, mask, scale))
    for a, b, c in blocks(start, start + q.shape[2], 0, k.shape[2], is_causal):
        gq, gk, gv = run_backward(grad_out, q, k[:, :, a:b], v[:, :, a:b], out, lse, c, None, scale)
        dq = dq + gq
        dk = dk.slice_scatter(gk, 2, a, b) if (a, b) != (0, k.shape[2]) else gk
        dv = dv.slice_scatter(gv, 2, a, b) if (a, b) != (0, k.shape[2]) else gv
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# ring attention


def _rows(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return x.narrow(2, a, b - a)


def _move(
    ts: list[torch.Tensor], have: list[tuple[int, int, int]], want: list[tuple[int, int, int]], n: int, rank: int, group
) -> list[list[torch.Tensor]]:
    """Move row segments between ranks in one ``all_to_all_single``. ``have``: (segment, dst,
    rows) of each local segment, laid out in that order along dim 2; ``want``: (segment, src,
    rows) of the segments to receive. The tensors ((B, H, S, D) or a log-sum-exp's (B, H, S), one
    dtype) travel packed along their last dim; a segment that stays on this rank is not sent.
    Returns, per tensor, the received segments in ``want`` order."""
    packed = torch.cat([t if t.ndim == 4 else t.unsqueeze(-1) for t in ts], dim=-1)
    lead, width = packed.shape[:2], packed.shape[-1]
    row = math.prod(lead) * width
    offs = [0]
    for _, _, rows in have:
        offs.append(offs[-1] + rows)
    local = {seg: _rows(packed, offs[i], offs[i + 1]) for i, (seg, dst, _) in enumerate(have) if dst == rank}
    out_order = sorted((dst, seg, i) for i, (seg, dst, _) in enumerate(have) if dst != rank)
    in_order = sorted((src, seg, rows) for seg, src, rows in want if src != rank)
    send, recv = [0] * n, [0] * n
    for dst, _, i in out_order:
        send[dst] += have[i][2] * row
    for src, _, rows in in_order:
        recv[src] += rows * row
    flat = torch.cat(
        [_rows(packed, offs[i], offs[i + 1]).reshape(-1) for _, _, i in out_order] or [packed.new_zeros(0)]
    )
    got = funcol.all_to_all_single(flat, recv, send, group)
    pieces = dict(local)
    for (_, seg, rows), p in zip(in_order, got.split([rows * row for _, _, rows in in_order])):
        pieces[seg] = p.reshape(*lead, rows, width)
    if not in_order:  # nothing comes to this rank: still wait for the exchange (``_tie``)
        seg = want[0][0]
        pieces[seg] = _tie(pieces[seg], got)
    out, col = [], 0
    for t in ts:
        w = t.shape[-1] if t.ndim == 4 else 1
        segs = [pieces[s][..., col : col + w] for s, _, _ in want]
        out.append([x if t.ndim == 4 else x.squeeze(-1) for x in segs])
        col += w
    return out


def _zigzag_moves(S: int, n: int, rank: int, back: bool):
    """(have, want) for ``_move``: this rank's contiguous halves to their zigzag ranks, or back."""
    hs = halves(S, n)
    rows = [b - a for a, b in hs]
    contiguous = [(h, zigzag_owner(h, n), rows[h]) for h in (2 * rank, 2 * rank + 1)]
    zigzag_halves = [(h, h // 2, rows[h]) for h in zigzag(rank, n)]
    return (zigzag_halves, contiguous) if back else (contiguous, zigzag_halves)


def _by_dtype(ts: list, move) -> list:
    """``move`` applied to the tensors of each dtype together (one exchange per dtype)."""
    out: list = [None] * len(ts)
    for dtype in dict.fromkeys(t.dtype for t in ts):
        idx = [i for i, t in enumerate(ts) if t.dtype == dtype]
        for i, r in zip(idx, move([ts[i] for i in idx])):
            out[i] = r
    return out


def _to_zigzag(ts: list[torch.Tensor], S: int, n: int, rank: int, group) -> list[list[torch.Tensor]]:
    """This rank's zigzag query half-chunks of each tensor."""
    return _by_dtype(ts, lambda g: _move(g, *_zigzag_moves(S, n, rank, False), n, rank, group))


def _from_zigzag(ts: list[torch.Tensor], S: int, n: int, rank: int, group) -> list[torch.Tensor]:
    """The contiguous chunks back from tensors holding this rank's two zigzag half-chunks."""
    return _by_dtype(
        ts, lambda g: [torch.cat(x, dim=2) for x in _move(g, *_zigzag_moves(S, n, rank, True), n, rank, group)]
    )


def _shift(
    ts: list[torch.Tensor], shapes: list[list[int]], n: int, rank: int, group, send: bool = True, recv: bool = True
) -> list[torch.Tensor]:
    """Send ``ts`` (one dtype) to the next rank; receive tensors of ``shapes`` from the previous.
    ``send``/``recv`` False: nothing goes that way (the receiver will not use it); an empty tensor
    is returned for each shape then."""
    flat = torch.cat([t.reshape(-1) for t in ts])
    sizes, counts = [0] * n, [0] * n
    sizes[(rank + 1) % n] = flat.numel() if send else 0
    counts[(rank - 1) % n] = sum(math.prod(s) for s in shapes) if recv else 0
    got = funcol.all_to_all_single(flat if send else flat[:0], counts, sizes, group)
    if not recv:
        return [got] * len(shapes)
    return [p.reshape(s) for p, s in zip(got.split([math.prod(s) for s in shapes]), shapes)]


def _tie(x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    """``x``, made to depend on an exchange's empty output, so that the exchange is waited for
    (a functional collective nobody reads is never waited: torch warns of it at exit)."""
    return torch.cat([x.reshape(-1), unused.reshape(-1)[:0].to(x.dtype)]).view(x.shape)


def _next_kv(kc, vc, k, v, S: int, n: int, rank: int, t: int, group, causal: bool):
    """Step t's K/V pass: this rank's chunk to the next rank, the previous rank's to this one."""
    bounds = chunk_bounds(S, n)
    src = (rank - t - 1) % n
    rows = bounds[src][1] - bounds[src][0]
    send, recv = kv_sends(S, n, rank, t, causal), kv_sends(S, n, (rank - 1) % n, t, causal)
    return _shift([kc, vc], [_chunk_shape(k, rows), _chunk_shape(v, rows)], n, rank, group, send, recv), recv


def _chunk_shape(x: torch.Tensor, rows: int) -> list[int]:
    return [*x.shape[:2], rows, *x.shape[3:]]


def _query_segments(q_like: list[torch.Tensor], S: int, n: int, rank: int, group, causal: bool):
    """(global row ranges, per-tensor segments) this rank runs (``query_ranges``)."""
    if not causal:
        return query_ranges(S, n, rank, causal), [[t] for t in q_like]
    return query_ranges(S, n, rank, causal), _to_zigzag(q_like, S, n, rank, group)


def _block_mask(mask, qa: int, qb: int, a: int, b: int, mask_start: int = 0):
    """The mask's block for query rows ``qa..qb`` and keys ``a..b`` (global), of a mask holding
    rows from ``mask_start`` on."""
    return None if mask is None else mask.narrow(-2, qa - mask_start, qb - qa).narrow(-1, a, b - a)


def _masked_lse(lse: torch.Tensor, mask) -> torch.Tensor:
    """The kernel gives a row whose keys are all masked (-inf) a log-sum-exp of 0: it is -inf,
    for the merge (the row has no weight in this block)."""
    if mask is None:
        return lse
    return lse.masked_fill((mask == float("-inf")).all(-1).expand(lse.shape), float("-inf"))


def _merge(out, lse, o, s, masked: bool):
    """Two partial attention results (out, lse) and (o, s) over disjoint keys, by their
    log-sum-exps (under a mask, rows without any key yet stay at -inf with weight 0)."""
    m = torch.logaddexp(lse, s)
    base = m.masked_fill(m == float("-inf"), 0.0) if masked else m
    return out * torch.exp(lse - base).unsqueeze(-1) + o * torch.exp(s - base).unsqueeze(-1), m


def _add(acc: torch.Tensor | None, x: torch.Tensor, a: int, b: int, rows: int) -> torch.Tensor:
    """``acc`` (rows ``0 .. rows``, None for zeros) plus ``x`` at rows ``a .. b``, with as few
    ops as the case needs (the unrolled ring makes every op count in compile time)."""
    if a == 0 and b == rows:
        return x if acc is None else acc + x
    if acc is None:
        acc = x.new_zeros(_chunk_shape(x, rows))
    return acc.slice_scatter(_rows(acc, a, b) + x, 2, a, b)


def ring_attention(
    q,
    k,
    v,
    *,
    S: int,
    rank: int,
    n: int,
    group,
    is_causal: bool,
    scale=None,
    attn_mask=None,
    mask_start: int = 0,
    kernel: str = CPU_FLASH.name,
):
    """(out, logsumexp) of the attention ``kernel`` (``_attention_ops.BY_NAME``) for this rank's
    contiguous chunk of a sequence of ``S``, with q, k, v all sequence-sharded (and the mask, if
    any, whole or this rank's rows, from global row ``mask_start``: each block reads its rows and
    columns)."""
    acc, run = acc_dtype(q.dtype), BY_NAME[kernel].run
    ranges, (qs,) = _query_segments([q], S, n, rank, group, is_causal)
    outs: list = [None] * len(qs)
    lses: list = [None] * len(qs)
    kc, vc = k, v
    bounds = chunk_bounds(S, n)
    unused = None
    for t in range(n):
        j = (rank - t) % n
        if t < n - 1:  # the next chunk travels while this one is used
            nxt, used = _next_kv(kc, vc, k, v, S, n, rank, t, group, is_causal)
        ka, kb = bounds[j]
        for i, ((qa, qb), qt) in enumerate(zip(ranges, qs)):
            for a, b, c in blocks(qa, qb, ka, kb, is_causal):
                mask = _block_mask(attn_mask, qa, qb, a, b, mask_start)
                o, s = run(qt, _rows(kc, a - ka, b - ka), _rows(vc, a - ka, b - ka), c, mask, scale)
                o, s = o.to(acc), _masked_lse(s.to(acc), mask)
                if outs[i] is None:
                    outs[i], lses[i] = o, s
                else:
                    outs[i], lses[i] = _merge(outs[i], lses[i], o, s, attn_mask is not None)
        if t < n - 1:
            kc, vc = nxt
            unused = None if used else kc
    for i, qt in enumerate(qs):
        if outs[i] is None:  # no rows (fewer tokens than half-chunks)
            outs[i] = qt.new_zeros([*qt.shape[:3], v.shape[3]], dtype=acc)
            lses[i] = qt.new_zeros(qt.shape[:3], dtype=acc)
    out, lse = torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)
    if attn_mask is not None:  # rows that see no key at all: the kernel's 0
        lse = lse.masked_fill(lse == float("-inf"), 0.0)
    if unused is not None:
        lse = _tie(lse, unused)
    return (out, lse) if not is_causal else tuple(_from_zigzag([out, lse], S, n, rank, group))


def ring_attention_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    *,
    S: int,
    rank: int,
    n: int,
    group,
    is_causal: bool,
    scale=None,
    attn_mask=None,
    mask_start: int = 0,
    kernel: str = CPU_FLASH.name,
):
    """(grad q, grad k, grad v) of this rank's chunks: K/V travel the ring again, and behind them
    the accumulators of their gradients, which arrive home after the last step."""
    acc, run_backward = acc_dtype(q.dtype), BY_NAME[kernel].run_backward
    ranges, (gos, qs, os_, ls) = _query_segments([grad_out, q, out, lse], S, n, rank, group, is_causal)
    dqs: list = [None] * len(qs)
    bounds = chunk_bounds(S, n)
    kc, vc = k, v
    dkv, unused = None, None
    for t in range(n):
        j = (rank - t) % n
        if t < n - 1:
            nxt, used = _next_kv(kc, vc, k, v, S, n, rank, t, group, is_causal)
        ka, kb = bounds[j]
        gk = gv = None
        for i, (qa, qb) in enumerate(ranges):
            for a, b, c in blocks(qa, qb, ka, kb, is_causal):
                d_q, d_k, d_v = run_backward(
                    gos[i],
                    qs[i],
                    _rows(kc, a - ka, b - ka),
                    _rows(vc, a - ka, b - ka),
                    os_[i],
                    ls[i],
                    c,
                    _block_mask(attn_mask, qa, qb, a, b, mask_start),
                    scale,
                )
                dqs[i] = _add(dqs[i], d_q.to(acc), 0, qb - qa, qb - qa)
                gk = _add(gk, d_k.to(acc), a - ka, b - ka, kb - ka)
                gv = _add(gv, d_v.to(acc), a - ka, b - ka, kb - ka)
        if gk is None:  # no row of this rank sees the chunk
            gk, gv = (x.new_zeros(_chunk_shape(x, kb - ka), dtype=acc) for x in (k, v))
        if dkv is not None:  # the accumulators from the previous rank, waited for only now
            gk, gv = gk + dkv[0], gv + dkv[1]
        a, b = bounds[(j - 1) % n]  # the chunk the previous rank holds now
        dkv = _shift([gk, gv], [_chunk_shape(gk, b - a), _chunk_shape(gv, b - a)], n, rank, group)
        if t < n - 1:
            kc, vc = nxt
            unused = None if used else kc
    dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
    if unused is not None:
        dk = _tie(dk, unused)
    dqs = [x if x is not None else torch.zeros_like(qs[i], dtype=acc) for i, x in enumerate(dqs)]
    dq = torch.cat(dqs, dim=2).to(q.dtype)
    return (_from_zigzag([dq], S, n, rank, group)[0] if is_causal else dq), dk, dv


# ---------------------------------------------------------------------------------------------
# hybrid: Ulysses within sub-groups of u ranks, ring attention across the n / u sub-groups


def _seq_to_heads(x: torch.Tensor, u: int, i: int, group) -> torch.Tensor:
    """(B, H, c, ...) sequence chunks of the u ranks of a sub-group -> (B, H / u, u c, ...): this
    rank's heads of the sub-group's sequence, Shard(2) -> Shard(1) over the sub-group (the plan's
    own all-to-all; the length divides evenly, which the hybrid's rule requires)."""
    shape = [*x.shape[:2], u * x.shape[2], *x.shape[3:]]
    return redistribute(x, Shard(2), Shard(1), u, i, group, shape)


def _heads_to_seq(x: torch.Tensor, u: int, i: int, group) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``."""
    shape = [x.shape[0], u * x.shape[1], *x.shape[2:]]
    return redistribute(x, Shard(1), Shard(2), u, i, group, shape)


def _mask_heads(mask, u: int, i: int):
    """This rank's heads of a per-head mask (a mask broadcast over heads stays whole)."""
    if mask is None or mask.shape[1] == 1:
        return mask
    h = mask.shape[1] // u
    return mask.narrow(1, i * h, h)


def hybrid_attention(
    q,
    k,
    v,
    *,
    S: int,
    rank: int,
    n: int,
    u: int,
    inner,
    outer,
    is_causal: bool,
    scale=None,
    attn_mask=None,
    kernel: str = CPU_FLASH.name,
):
    """(out, logsumexp) for this rank's chunk: all-to-alls within the sub-group turn its u chunks
    into this rank's H / u heads of the sub-group's sequence, ring attention runs across the
    n / u sub-groups on those heads, and all-to-alls turn the result back."""
    g, i = divmod(rank, u)
    qh, kh, vh = (_seq_to_heads(x, u, i, inner) for x in (q, k, v))
    out, lse = ring_attention(
        qh,
        kh,
        vh,
        S=S,
        rank=g,
        n=n // u,
        group=outer,
        is_causal=is_causal,
        scale=scale,
        attn_mask=_mask_heads(attn_mask, u, i),
        kernel=kernel,
    )
    return _heads_to_seq(out, u, i, inner), _heads_to_seq(lse, u, i, inner)


def hybrid_attention_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    *,
    S: int,
    rank: int,
    n: int,
    u: int,
    inner,
    outer,
    is_causal: bool,
    scale=None,
    attn_mask=None,
    kernel: str = CPU_FLASH.name,
):
    """(grad q, grad k, grad v): the same all-to-alls, the ring's backward across the sub-groups,
    and the gradients back."""
    g, i = divmod(rank, u)
    go, qh, kh, vh, oh, lh = (_seq_to_heads(x, u, i, inner) for x in (grad_out, q, k, v, out, lse))
    dq, dk, dv = ring_attention_backward(
        go,
        qh,
        kh,
        vh,
        oh,
        lh,
        S=S,
        rank=g,
        n=n // u,
        group=outer,
        is_causal=is_causal,
        scale=scale,
        attn_mask=_mask_heads(attn_mask, u, i),
        kernel=kernel,
    )
    return tuple(_heads_to_seq(x, u, i, inner) for x in (dq, dk, dv))


# ---------------------------------------------------------------------------------------------
# the per-rank graph's view of ring and hybrid attention: one opaque op each way. Unrolled into
# the graph, a ring is hundreds of small ops per layer (compile time grew 40% on a 3-layer toy)
# and its exchanges, some of which only one rank's compute uses, are at the partitioner's mercy.


def _waited(ts, inputs) -> tuple[torch.Tensor, ...]:
    """The kernel's results as a custom op must return them: waited for, contiguous (the fake
    kernel's strides), and sharing memory with no input and no other result (K and V gradients
    arrive as views of one exchange buffer)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    out = []
    for t in ts:
        t = (t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t).contiguous()  # as the fake says
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return tuple(out)


@torch.library.custom_op("autosp::ring_attention", mutates_args=())
def ring_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    S: int,
    rank: int,
    n: int,
    group: str,
    is_causal: bool,
    scale: float | None,
    u: int,
    inner: str,
    mask_start: int = 0,
    block_kernel: str = CPU_FLASH.name,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of this rank's chunk: ring attention over ``group`` (``u == 1``), or hybrid
    attention with sub-groups of ``u`` (``inner`` within, ``group`` across; the mask whole), each
    block run by the attention kernel ``block_kernel`` (``_attention_ops.BY_NAME``; not named
    ``kernel``: Inductor passes an op it does not lower to ``FallbackKernel.create(kernel, ...)``,
    and an argument of that name given by keyword collided with it)."""
    kw = dict(S=S, rank=rank, n=n, is_causal=is_causal, scale=scale, attn_mask=attn_mask, kernel=block_kernel)
    if u > 1:
        return _waited(hybrid_attention(query, key, value, u=u, inner=inner, outer=group, **kw), (query, key, value))
    return _waited(ring_attention(query, key, value, group=group, mask_start=mask_start, **kw), (query, key, value))


@ring_attention_op.register_fake
def _(query, key, value, attn_mask, S, rank, n, group, is_causal, scale, u, inner, mask_start=0, block_kernel=""):
    return (
        query.new_empty([*query.shape[:3], value.shape[3]]),
        query.new_empty(query.shape[:3], dtype=acc_dtype(query.dtype)),
    )


@torch.library.custom_op("autosp::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    attn_mask: torch.Tensor | None,
    S: int,
    rank: int,
    n: int,
    group: str,
    is_causal: bool,
    scale: float | None,
    u: int,
    inner: str,
    mask_start: int = 0,
    block_kernel: str = CPU_FLASH.name,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad query, grad key, grad value) of this rank's chunks (see ``ring_attention_op``)."""
    kw = dict(S=S, rank=rank, n=n, is_causal=is_causal, scale=scale, attn_mask=attn_mask, kernel=block_kernel)
    args = (grad_out, query, key, value, out, logsumexp)
    if u > 1:
        return _waited(hybrid_attention_backward(*args, u=u, inner=inner, outer=group, **kw), args)
    return _waited(ring_attention_backward(*args, group=group, mask_start=mask_start, **kw), args)


@ring_attention_backward_op.register_fake
def _(grad_out, query, key, value, out, logsumexp, *_):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


RING = torch.ops.autosp.ring_attention.default
RING_BACKWARD = torch.ops.autosp.ring_attention_backward.default
ATTENTION_OPS.update({RING: False, RING_BACKWARD: True})


# ---------------------------------------------------------------------------------------------
# the per-rank calls of attention ops planned with the query sequence-sharded


def _sequence_call(nd, s, target, args, kwargs, ctx):
    """(kernel, args, kwargs) for an attention op on this rank's query rows: against gathered K/V
    (the query's first row in the global sequence places its causal block), or as ring or hybrid
    attention (one op each way, ``autosp::ring_attention``), each block run by the op's kernel. A
    forward returns the kernel's whole output tuple (``AttentionOp.outputs``)."""
    op = attention_op(target)
    a = normalize_function(target, args, kwargs, normalize_to_only_use_kwargs=True).kwargs
    backward = target is op.backward
    q = out_vals(op_args(nd)["query"])[0]
    S = q.shape[2]
    mask = a.get(op.mask) if op.mask else None
    common = dict(is_causal=bool(a["is_causal"]), scale=a["scale"], attn_mask=mask, kernel=op.name)
    start = chunk_start(S, ctx.n, ctx.rank)
    # a mask split by rows (``propagate._attention._rows_mask``) holds this rank's rows
    placed = dict(zip(input_names(nd), s.ins))
    common.update(mask_start=start if op.mask in placed and is_shard(placed[op.mask]) else 0)
    if s.kernel == Kernel.KV_GATHER:
        common.update(start=start)
        fn = kv_gathered_attention_backward if backward else kv_gathered_attention
    else:
        u, inner, outer = (ctx.ulysses, ctx.inner, ctx.outer) if s.kernel == Kernel.HYBRID else (1, "", ctx.group)
        common.update(S=S, rank=ctx.rank, n=ctx.n, group=outer, u=u, inner=inner, block_kernel=common.pop("kernel"))
        fn = ring_attention_backward_op if backward else ring_attention_op
    if backward:

        def backward_call(grad_out, q, k, v, out, lse, **kw):  # a padded log-sum-exp: its rows only
            return fn(grad_out, q, k, v, out, lse.narrow(2, 0, q.shape[2]) if op.lse_rows > 1 else lse, **kw)

        return backward_call, tuple(a[k] for k in (op.grad_out, "query", "key", "value", "out", "logsumexp")), common

    def forward(q, k, v, **kw):
        return op.outputs(*fn(q, k, v, **kw), q, k)

    return forward, (a["query"], a["key"], a["value"]), common


# kernel -> the per-rank call of an attention op the plan runs with it (Ulysses and the batch
# split run the op itself, on its heads or sequences)
SEQUENCE_KERNELS = {Kernel.KV_GATHER: _sequence_call, Kernel.RING: _sequence_call, Kernel.HYBRID: _sequence_call}
