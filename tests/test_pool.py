"""The test pool never holds CI: a rank that hangs, or exits while the others wait for it in a
collective, fails its test within the run's timeout with the ranks' stacks (pure tier: no autosp,
two bare gloo workers)."""

import time

import cases
import pytest
from _pool import Pool


@pytest.fixture
def pool():
    p = Pool(2)
    yield p
    p.close()


def test_a_rank_that_never_answers_fails_its_test_within_the_timeout_with_its_stack(pool):
    # started and imported first: under load (a suite beside it) a worker's imports alone took
    # longer than the 5 s timeout, and the message named both ranks
    assert pool.run(cases.hang_on_rank, -1) == ["answered"] * 2
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        pool.run(cases.hang_on_rank, 1, timeout=5.0)
    took = time.monotonic() - t0
    msg = str(err.value)
    assert "no answer within 5.0 s from 1 rank(s) during hang_on_rank(1,)" in msg, msg
    # the stack of the rank that hangs names the line it hangs on
    assert "--- rank 1 stack ---" in msg and "in hang_on_rank" in msg, msg
    assert took < 15.0, took
    assert pool.broken  # the pools fixture starts a fresh one for the next test


def test_a_rank_that_exits_mid_collective_fails_its_test_at_once(pool):
    assert pool.run(cases.hang_on_rank, -1) == ["answered"] * 2  # started and imported first
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        pool.run(cases.exit_in_collective, 1, timeout=120.0)
    took = time.monotonic() - t0
    msg = str(err.value)
    assert "worker(s) died (rank, exit code) [(1, 3)] during exit_in_collective(1,)" in msg, msg
    # rank 0's collective lost its peer: its traceback comes with the message
    assert "--- rank 0 ---" in msg and "in exit_in_collective" in msg.split("--- rank 0 ---")[1], msg
    assert took < 15.0, took  # not the 120 s timeout, nor the process group's
