"""FlexAttention block masks passed into a step on a symbolic length.

A ``BlockMask`` holds its lengths as Python ints and its block tables with one entry per block
of the length; flex_attention compares the lengths with the query's. Dynamo makes an int it
reads a constant (autosp marks only the sharded dims symbolic, with automatic dynamic shapes
off), so each new length compiled the step again: 4 compiles for 64, 37, 50 and 61 tokens, and a
ninth length would have met Dynamo's recompile limit (8).

On a symbolic length each block mask among the inputs therefore travels as a ``BlockMaskInput``:
its lengths as the sizes of two empty tensors, its block tables as aliases, each with those dims
marked symbolic, and the tensors its mask function captures (document ids) marked symbolic along
a dim of either length (in place: they are the function's own). Inside the traced step the mask
is rebuilt (``rebuilt``), its lengths then expressions of the symbolic ones.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..propagate._flex import BLOCK_TABLES, DQ_ORDERS

__all__ = ["BlockMaskInput", "block_mask_inputs", "rebuilt"]

# BlockMask's tables and deterministic dQ orders (``dq_kv_order_spt`` a bool), as its constructor
# names them
_FIELDS, _KEYWORDS = BLOCK_TABLES, DQ_ORDERS


@dataclasses.dataclass
class BlockMaskInput:
    """A block mask as a step's input: ``rows`` (q_len, 0) and ``cols`` (0, kv_len) carry its
    lengths, ``fields`` its tables (and the rest of its constructor's arguments)."""

    rows: torch.Tensor
    cols: torch.Tensor
    fields: dict[str, Any]
    block_size: tuple[int, int]
    mask_mod: Callable


def _captured(fn, seen: set[int]):
    """The tensors a function captures: in its closure, a partial's arguments, nested functions."""
    if id(fn) in seen:
        return
    seen.add(id(fn))
    if isinstance(fn, torch.Tensor):
        yield fn
    elif isinstance(fn, (tuple, list)):
        for x in fn:
            yield from _captured(x, seen)
    elif isinstance(fn, functools.partial):
        yield from _captured((fn.func, *fn.args, *fn.keywords.values()), seen)
    elif callable(fn):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                yield from _captured(cell.cell_contents, seen)
            except ValueError:  # an empty cell
                continue


def _symbolic(t: torch.Tensor, sizes: set[int], first: int = 0) -> None:
    for d in range(first, t.ndim):
        if t.shape[d] > 1 and (not sizes or t.shape[d] in sizes):
            torch._dynamo.maybe_mark_dynamic(t, d)


def _carried(mask: BlockMask) -> BlockMaskInput:
    q_len, kv_len = mask.seq_lengths
    rows, cols = torch.empty(q_len, 0), torch.empty(0, kv_len)
    _symbolic(rows, set())
    _symbolic(cols, set())
    fields = {}
    for name in (*_FIELDS, *_KEYWORDS):
        x = getattr(mask, name, None)
        if isinstance(x, torch.Tensor):
            x = x.view_as(x)
            _symbolic(x, set(), first=2)  # (batch, heads, blocks[, blocks])
        fields[name] = x
    for t in _captured(mask.mask_mod, set()):
        _symbolic(t, {q_len, kv_len})
    return BlockMaskInput(rows, cols, fields, tuple(mask.BLOCK_SIZE), mask.mask_mod)


def _has(x, kind) -> bool:
    if isinstance(x, (tuple, list)):
        return any(_has(a, kind) for a in x)
    if isinstance(x, dict):
        return any(_has(v, kind) for v in x.values())
    return isinstance(x, kind)


def _each(x, fn, kind):
    """``x`` with ``fn`` applied to its leaves of type ``kind`` inside tuples, lists and dicts;
    ``x`` itself where it holds none."""
    if not _has(x, kind):
        return x
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return type(x)(*(_each(a, fn, kind) for a in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_each(a, fn, kind) for a in x)
    if isinstance(x, dict):
        return {k: _each(v, fn, kind) for k, v in x.items()}
    return fn(x)


def block_mask_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs with each block mask as a ``BlockMaskInput`` (see the module docstring)."""

    return _each(args, _carried, BlockMask), _each(kwargs, _carried, BlockMask)


def rebuilt(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Inside the traced step: each ``BlockMaskInput`` a block mask again."""

    def mask(x: BlockMaskInput) -> BlockMask:
        f = x.fields
        return BlockMask(
            (x.rows.shape[0], x.cols.shape[1]),
            *(f[name] for name in _FIELDS),
            BLOCK_SIZE=x.block_size,
            mask_mod=x.mask_mod,
            **{name: f[name] for name in _KEYWORDS},
        )

    return _each(args, mask, BlockMaskInput), _each(kwargs, mask, BlockMaskInput)
