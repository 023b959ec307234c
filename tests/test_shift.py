"""Shifts along the sequence run as halo exchanges: each rank receives only the boundary rows it
needs from the rank that holds them, never the whole tensor. The logits-shift loss (nanoGPT's
``logits[:, :-1]`` against ``labels[:, 1:]``) moves nothing beyond the label-shift loss when the
length divides by the ranks, and a few boundary rows when it does not; token shifts (``F.pad``,
``nn.ZeroPad2d``, a cat of shifted pieces, a masked roll), a causal convolution written as
shifted slices, a slice with both ends, a pad with a value and a roll that wraps around move a row
or two per boundary; ``nn.Conv1d`` along the sequence (Mamba's causal depthwise one, a dense
dilated one) moves its reach; a flip along the features moves nothing. Before, each of these all-gathered its input
(for the logits-shift loss: the whole logits, b x s x vocab, on every rank)."""

import math

import cases
import pytest
import torch
import torch.nn.functional as F
from _checks import assert_exact, assert_matmuls_split, tier

import autosp
from autosp.propagate import Window, flip_pieces, halo_pieces
from examples.models import Llama, LlamaConfig

# every shift on an uneven split over 4 ranks; the commonest also on 2, and at 64 over 4, 7 over 2
# and 3 over 4 (a rank with no rows)
MAIN = ("logits_shift", "token_shift_pad", "conv1d_causal")
CASES = (
    [(k, 4, 45) for k in cases.SHIFTS]
    + [(k, 2, 64) for k in (*MAIN, "token_shift_cat", "roll_wrap")]
    + [(k, w, L) for k in MAIN for w, L in [(4, 64), (2, 7), (4, 3)]]
    + [("unfold_window", 2, 7), ("unfold_window", 4, 6)]  # 6 rows over 4: one rank has no window
)


# the fast tier: every shift on an uneven split over 4 ranks, and a rank with no rows
@pytest.mark.parametrize("kind,world,L", tier(CASES, [c for c in CASES if c[1:] in ((4, 45), (4, 3))]))
def test_shifts_match_one_device_and_gather_nothing(pools, kind, world, L):
    """Exact on even and uneven splits (45 tokens over 4 ranks: 12, 11, 11, 11; 7 over 2; 3 over
    4: 1, 1, 1, 0), with no all-gather: the only collectives are the halo exchanges and the loss and gradient
    all-reduces."""
    results = pools(world).run(cases.shift_exactness, kind, 2, L)
    assert_matmuls_split(results, L)
    for r in results:
        assert_exact(r)
        assert {k for k, _ in r["collectives"]} <= {"halo", "all_reduce"}, r["collectives"]
        # per exchange a few rows of the (2, L, 16) fp32 hidden state a rank: the shift or the
        # convolution's reach (3 rows), and where the split is uneven up to a row per rank more
        # (a convolution's backward exchanges twice), never the tensor; a flip along the
        # sequence moves the rank's own rows (to the mirrored rank), as an all-to-all would
        row = 2 * 16 * 4
        rows = math.ceil(L / world) if kind == "flip_sequence" else 2 * (3 + world)
        assert max(r["halo_bytes"], default=0.0) <= rows * row, r
        if kind == "logits_shift" and L % world == 0:
            assert not r["halo_bytes"], r  # every rank's logits rows are its own (the last holds one fewer)


def test_flip_schedule_sends_each_rank_its_mirrored_rows():
    """A flip of 5 rows over 2 ranks (3, 2): rank 0's output rows 0-2 are input rows 4-2, so it
    receives rows 3-4 from rank 1 and keeps row 2; rank 1's are rows 1-0, all from rank 0."""
    assert flip_pieces(5, 2) == [(0, 0, 2, 1), (1, 0, 3, 2), (0, 1, 0, 2)]
    assert flip_pieces(4, 4) == [(3, 0, 3, 1), (2, 1, 2, 1), (1, 2, 1, 1), (0, 3, 0, 1)]


def test_halo_schedule_moves_boundary_rows_only():
    """The schedule: a token shift on 8 rows over 2 ranks sends one row (rank 0's last to rank 1);
    the logits shift on 8 rows sends nothing, and on 9 rows (5, 4 -> 4, 4) rank 0's last row;
    dropping the first of 9 rows (``x[:, 1:]``) sends nothing."""
    moved = lambda w, n: [(r, q, a, k) for r, q, a, k in halo_pieces(w, n) if r != q]  # noqa: E731
    assert moved(Window(1, 8, 8, -1), 2) == [(0, 1, 3, 1)]
    assert moved(Window(1, 8, 7, 0), 2) == []
    assert moved(Window(1, 9, 8, 0), 2) == [(0, 1, 4, 1)]
    assert moved(Window(1, 9, 8, 1), 2) == []
    assert moved(Window(1, 8, 8, -1), 4) == [(0, 1, 1, 1), (1, 2, 3, 1), (2, 3, 5, 1)]


def _length(hint: int):
    """A symbolic length (its own shape env) with ``hint``."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    return env, env.create_symintnode(env.create_symbol(hint, source=ConstantSource("S")), hint=hint)


# windows (of a length S) whose pieces, at uneven splits, depend on S mod n: a causal convolution
# with its padding (S -> S + 3 rows, reading 3 past) and its gradient's window, a token shift, the
# logits shift, a slice of both ends
WINDOWS = {
    "conv_causal": lambda S: Window(2, S, S + 3, -3, extra=3),
    "conv_causal_grad": lambda S: Window(2, S + 3, S, 0, extra=3),
    "token_shift": lambda S: Window(1, S, S, -1),
    "logits_shift": lambda S: Window(1, S, S - 1, 0),
    "both_ends": lambda S: Window(1, S, S - 3, 2),
}


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("window", [*WINDOWS, "flip"])
def test_symbolic_halo_schedule_is_exact_at_every_length_its_guard_admits(window, n):
    """On a symbolic length the pieces are plain expressions of it, no ``Min``/``Max`` (clamped
    ones cost Inductor 6 min 47 s of sympy in one rank's forward compile of a causal convolution on 2
    ranks, then a "PolynomialError"), and at every length the compile's guard admits, up to 12
    rows a rank, they are the pieces of that length computed on numbers (zero-row pieces aside:
    a piece empty at some residues of the length is kept as an empty slice)."""
    import sympy

    env, S = _length(8 * n + 5)
    pieces = flip_pieces(S, n) if window == "flip" else halo_pieces(WINDOWS[window](S), n)
    exprs = [sympy.sympify(v.node.expr if isinstance(v, torch.SymInt) else v) for p in pieces for v in p[2:]]
    assert not any(e.has(sympy.Min, sympy.Max) for e in exprs), exprs
    symbol = S.node.expr
    lowest = int(env.var_to_range[symbol].lower)  # 2: Dynamo compiles lengths 0 and 1 apart
    admitted = [L for L in range(lowest, 12 * n) if all(bool(g.expr.subs(symbol, L)) for g in env.guards)]
    assert 8 * n + 5 in admitted and admitted[-1] == 12 * n - 1, admitted  # one lower bound
    for L in admitted:
        values = [int(e.subs(symbol, L)) for e in exprs]
        at = [(r, q, values[2 * i], values[2 * i + 1]) for i, (r, q, _, _) in enumerate(pieces)]
        want = flip_pieces(L, n) if window == "flip" else halo_pieces(WINDOWS[window](L), n)
        assert [p for p in at if p[3]] == [p for p in want if p[3]], (L, at, want)


def _plan(world, L, loss):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(heads=4, kv_heads=2, dim=64, layers=2))
    ids = torch.randint(0, 256, (2, L))
    fns = {
        "labels": lambda i, labels: model(i, labels),
        "logits": lambda i, labels: F.cross_entropy(
            model(i)[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1), ignore_index=-100
        ),
    }
    with autosp.mesh(sp=world):
        return autosp.explain(autosp.shard(fns[loss], compiler="aot_eager"), ids, ids)


@pytest.mark.parametrize("world,L", tier([(2, 64), (4, 64), (2, 63), (4, 45), (8, 96)], [(2, 63), (4, 45)]))
def test_logits_shift_loss_moves_no_more_than_the_label_shift_loss(fake_world, world, L):
    """On the Llama example the logits-shift loss's plan is the label-shift loss's (Ulysses'
    all-to-alls, the loss and gradient all-reduces) plus, where the length does not divide by
    the ranks, one halo exchange each way of at most one logits row per rank and sequence."""
    fake_world(world)
    by_label, by_logits = _plan(world, L, "labels"), _plan(world, L, "logits")
    assert not by_logits.count("all_gather"), str(by_logits)
    halo = [c for c in by_logits.collectives if c.kind == "halo"]
    row = 2 * 256 * 4  # one row of the (2, L, 256) fp32 logits
    assert by_logits.comm_bytes <= by_label.comm_bytes + sum(c.bytes_per_rank for c in halo) + 1e-6
    assert all(c.bytes_per_rank <= row for c in halo), halo
    if L % world == 0:
        assert not halo, halo
    else:
        assert len(halo) == 2, halo  # the slice forward, its gradient backward
    assert math.isclose(by_logits.comm_bytes - sum(c.bytes_per_rank for c in halo), by_label.comm_bytes, rel_tol=1e-9)
    # explain: beyond a hand-written Ulysses plan, the logits shift sends what the label shift
    # does (nothing, or a ring's K/V where the heads do not split) and the halo rows, named
    others = [c.kind for c in by_logits.beyond_ulysses if c.kind != "halo"]
    assert others == [c.kind for c in by_label.beyond_ulysses] and set(others) <= {"ring"}, others
    assert [c for c in by_logits.beyond_ulysses if c.kind == "halo"] == halo
    assert all("a shift or window along the sequence" in c.beyond for c in halo)
    assert all(f"halo x1 {c.bytes_per_rank / 2**20:.3f} MiB: {c.beyond}" in str(by_logits) for c in halo)
