"""Assertions the exactness tests share: the result is one device's, and the work is split."""

import math


def assert_exact(r: dict, tol: float = 1e-5) -> None:
    """The loss and every gradient within ``tol`` relative of one device's (the README's)."""
    loss, ref = r["loss"]
    assert abs(loss - ref) <= tol * max(abs(ref), 1e-6), r["loss"]
    worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
    assert worst[1] <= tol, worst


def assert_matmuls_split(results: list[dict], L: int) -> None:
    """Each rank's matmul FLOPs (``"flops"``: this rank's, one device's) are its share of one
    device's: together no more than one device's (no matmul runs whole on every rank), and none
    more than its ceil(L / N) rows and one (a shifted tensor splits its own length)."""
    world, single = len(results), results[0]["flops"][1]
    mine = [r["flops"][0] for r in results]
    assert single > 0 and sum(mine) <= 1.01 * single, (mine, single)
    assert max(mine) <= single * (math.ceil(L / world) + 1) / L, (mine, single)


def tier(values: list, fast: list) -> list:
    """``values`` for ``pytest.mark.parametrize``: those in ``fast`` in the fast tier (the README's
    test command), the others marked ``slow`` (``scripts/full_suite.sh`` runs them)."""
    import pytest

    return [
        v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow) for v in values
    ]
