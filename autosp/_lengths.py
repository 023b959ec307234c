"""Sizes clamped on a symbolic sequence length without ``Min``/``Max`` in the graph.

A halo exchange's pieces (``propagate._shift``) are rows clamped into each rank's share:
``min(max(lo, start), end)`` of expressions like ``(S + 3) // 2``. Written as ``sym_min`` /
``sym_max`` they reach Inductor as nested ``Min``/``Max`` of floor divisions, and its code
generation reasons about them in sympy: a causal depthwise convolution on 2 ranks spent 6 min 47 s
in one rank's forward compile and then stopped ("PolynomialError: Piecewise generators do not make
sense"; torch 2.13, ``tests/test_shift.py``'s ``conv1d_causal``).

Which of two such sizes is the smaller is, for all but the shortest lengths, the same at every
length: balanced shares of ``S`` and of ``S + 3`` start at most 3 rows apart whatever ``S mod n``
is. ``Lengths`` finds that answer and the length ``T`` from which it holds, keeps the one size, and
guards the compile to ``S >= T`` (one guard; a shorter length compiles again). The sizes are
expressions of one symbol built from sums, integer multiples and floor divisions by constants, so
on each class of ``S`` modulo the product ``P`` of the divisors they are exactly linear in
``S // P``: each size is carried with its values at three lengths of every class (``Sized``), and
the sign of a difference is read from them, in numbers, with no sympy. Anything else (two symbols,
a product of symbols, a clamp whose answer changes with ``S mod P``) stays ``sym_min`` / ``sym_max``.

Every rank computes the same answers from the same expressions and the length's hint (the same on
every rank), so the ranks' graphs agree. A size's expression is built only when it is read
(``Sized.value``): of a halo's n x n pieces, only those not empty at every length.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import sympy
import torch
from torch import sym_max, sym_min
from torch.utils._sympy.functions import CeilDiv, CleanDiv, FloorDiv, Mod, PythonMod

from ._graph import known_alike

__all__ = ["arithmetic", "plain", "Lengths", "Sized", "Numbers", "Clamped"]

_MAX_PERIOD = 4096  # classes of the length to sample; past it (nested divisions) clamps stay as they are


class Sized:
    """A size on a symbolic length: its values at the sample lengths (``at``: 3 x P, the lengths
    ``P * m + j`` for m = 0, 1, 2; None where it is not linear per class, a clamp kept) and its
    expression, built when read."""

    __slots__ = ("at", "_build", "_value")

    def __init__(self, at: np.ndarray | None, build: Callable[[], object]):
        self.at, self._build, self._value = at, build, None

    @property
    def value(self):
        """The size as a SymInt (or int) of the trace."""
        if self._value is None:
            self._value = self._build()
        return self._value

    def _op(self, other, fn):
        other = other if isinstance(other, Sized) else _constant(other)
        at = None if self.at is None or other.at is None else fn(self.at, other.at)
        return Sized(at, lambda: fn(self.value, other.value))

    def __add__(self, other):
        return self._op(other, lambda a, b: a + b)

    __radd__ = __add__

    def __sub__(self, other):
        return self._op(other, lambda a, b: a - b)

    def __rsub__(self, other):
        return self._op(other, lambda a, b: b - a)

    def __neg__(self):
        return Sized(None if self.at is None else -self.at, lambda: -self.value)

    def __mul__(self, k: int):
        assert isinstance(k, int)
        return Sized(None if self.at is None else self.at * k, lambda: self.value * k)

    __rmul__ = __mul__


def _constant(v) -> Sized:
    if isinstance(v, torch.SymInt):
        raise TypeError("autosp: a symbolic size enters a Sized computation through Lengths.size")
    return Sized(np.full((3, 1), int(v), dtype=np.int64), lambda: v)


class Numbers:
    """The same arithmetic on plain ints (a static length): the builtins."""

    @staticmethod
    def size(v):
        return v

    @staticmethod
    def value(v):
        return v

    least, greatest = staticmethod(min), staticmethod(max)

    @staticmethod
    def empty(v) -> bool:
        return v <= 0

    def guard(self) -> None:
        pass


class Clamped(Numbers):
    """Sizes on a symbolic length ``Lengths`` cannot read: ``sym_min``/``sym_max``, and a size is
    empty only where it is at every length (``known_alike``)."""

    least, greatest = staticmethod(sym_min), staticmethod(sym_max)

    @staticmethod
    def empty(v) -> bool:
        return known_alike(v <= 0)


def arithmetic(*sizes, n: int):
    """The arithmetic for sizes that are expressions of ``sizes`` split over ``n`` ranks:
    ``Numbers`` for numbers, ``Lengths`` where it reads them, else ``Clamped``. Each has
    ``size`` (a number or SymInt into it), ``least``, ``greatest``, ``empty``, ``value`` (out of
    it) and ``guard`` (call once the decisions are made)."""
    return Lengths.of(*sizes, n=n) or Clamped()


def plain(v):
    """``v``, a size on a symbolic length, as a number where it is one at every length (an offset
    like ``(S + 1) // 2 - (S + 3) // 2 + 2``): torch's shape env proves such a bound only late, and
    a narrow's bounds check then stopped in it (torch 2.13: "AssertionError: Expected
    Lt/Le/Eq/Ne, got BooleanTrue" in ``get_implications``)."""
    num = Lengths.of(v) if isinstance(v, torch.SymInt) else None
    return num.value(num.size(v)) if isinstance(num, Lengths) else v


class Lengths:
    """Sizes of one symbolic length, clamped by which is smaller from some length on (module
    docstring). ``Lengths.of(*sizes, n=n)``: None where the sizes are numbers or not of the form
    above (the caller keeps ``sym_min``/``sym_max``, ``Numbers`` for numbers)."""

    def __init__(self, env, symbol, period: int):
        self.env, self.symbol, self.period = env, symbol, period
        classes = np.arange(period, dtype=np.int64)
        self.lengths = np.stack([classes + m * period for m in range(3)])
        self.lowest = int(env.var_to_range[symbol].lower)  # Dynamo's lengths are 2 or more
        self.start = self.lowest  # the guard the decisions so far need: S >= start
        self.hint = env.backed_var_to_val.get(symbol)

    @classmethod
    def of(cls, *sizes, n: int = 1):
        syms = [v for v in sizes if isinstance(v, torch.SymInt) and v.node.expr.free_symbols]
        if not syms:
            return Numbers()
        free = set().union(*(v.node.expr.free_symbols for v in syms))
        if len(free) != 1:
            return None
        (symbol,) = free
        periods = [_period(v.node.expr, symbol) for v in syms]
        if None in periods:
            return None
        period = n * math.lcm(*periods)
        env = syms[0].node.shape_env
        if period > _MAX_PERIOD or env.backed_var_to_val.get(symbol) is None:
            return None
        return cls(env, symbol, period)

    def size(self, v) -> Sized:
        """``v`` (a SymInt of this length, or an int) as a ``Sized``."""
        if not isinstance(v, torch.SymInt):
            return _constant(v)
        expr = v.node.expr
        period = _period(expr, self.symbol) if expr.free_symbols <= {self.symbol} else None
        at = _evaluate(expr, self.symbol, self.lengths) if period and self.period % period == 0 else None
        return Sized(at, lambda: v)

    @staticmethod
    def value(v: Sized):
        """``v`` out of the arithmetic: a number where it is one at every length (a halo's rows
        once every shard holds them), so neither the graph nor Inductor sees an expression."""
        if v.at is not None and (v.at == v.at.flat[0]).all():
            return int(v.at.flat[0])
        return v.value

    def least(self, x, y) -> Sized:
        return self._pick(x, y, smaller=True)

    def greatest(self, x, y) -> Sized:
        return self._pick(x, y, smaller=False)

    def empty(self, v: Sized) -> bool:
        """Whether ``v`` is 0 (or less) at every length from the guard on."""
        start = None if v.at is None else self._eventually(-v.at)
        if start is None:
            return False
        self.start = max(self.start, start)
        return True

    def guard(self) -> None:
        """Guard the compile to the lengths the decisions hold at (one guard, ``S >= T``)."""
        cond = sympy.Ge(self.symbol, self.start)
        if self.start > self.lowest and cond is not sympy.true:  # sympy knows a positive symbol >= 1
            self.env.evaluate_expr(cond)

    def _pick(self, x, y, *, smaller: bool) -> Sized:
        x, y = (v if isinstance(v, Sized) else self.size(v) for v in (x, y))
        if x.at is not None and y.at is not None:
            for first, second in ((x, y), (y, x)):  # first <= second from the length returned on
                start = self._eventually(second.at - first.at)
                if start is not None:
                    self.start = max(self.start, start)
                    return first if smaller else second
        clamp = sym_min if smaller else sym_max
        return Sized(None, lambda: clamp(x.value, y.value))

    def _eventually(self, d: np.ndarray) -> int | None:
        """The length from which ``d >= 0`` in every class (``d`` at the sample lengths), where it
        is one the compile's length has reached; else None."""
        d = np.broadcast_to(d, self.lengths.shape)
        base, slope = d[0], d[1] - d[0]
        if not np.array_equal(d[2] - d[1], slope) or (slope < 0).any() or ((slope == 0) & (base < 0)).any():
            return None
        m = np.where(base >= 0, 0, -(base // np.where(slope == 0, 1, slope)))  # ceil(-base / slope)
        # past the longest length it fails at: in class j, P * (m_j - 1) + j
        failing = (m - 1) * self.period + self.lengths[0]
        start = max(int(failing[m > 0].max()) + 1 if (m > 0).any() else 0, self.lowest)
        return start if self.hint is not None and start <= self.hint else None


def _period(e, symbol) -> int | None:
    """A ``P`` such that ``e`` is linear in ``m`` on every class ``symbol = P * m + j``; None when
    ``e`` is not built from sums, integer multiples and floor divisions by constants."""
    if e == symbol or e.is_Integer:
        return 1
    if isinstance(e, sympy.Add):
        parts = [_period(a, symbol) for a in e.args]
        return None if None in parts else math.lcm(*parts)
    if isinstance(e, sympy.Mul):
        varying = [a for a in e.args if a.free_symbols]
        if len(varying) != 1 or not all(a.is_Integer for a in e.args if not a.free_symbols):
            return None
        return _period(varying[0], symbol)
    if isinstance(e, (FloorDiv, CeilDiv, Mod, PythonMod, CleanDiv)):
        num, den = e.args
        inner = _period(num, symbol) if den.is_Integer and den > 0 else None
        return None if inner is None else inner * int(den)
    return None


def _evaluate(e, symbol, s: np.ndarray) -> np.ndarray:
    """``e`` (of the form ``_period`` takes) at the lengths ``s``, exactly."""
    if e == symbol:
        return s
    if e.is_Integer:
        return np.full_like(s, int(e))
    args = [_evaluate(a, symbol, s) for a in e.args]
    if isinstance(e, sympy.Add):
        return sum(args[1:], args[0])
    if isinstance(e, sympy.Mul):
        return math.prod(args[1:], start=args[0])
    num, den = args
    if isinstance(e, (FloorDiv, CleanDiv)):
        return num // den
    if isinstance(e, CeilDiv):
        return -(-num // den)
    return num % den  # Mod, PythonMod
