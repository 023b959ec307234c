"""Properties: on any small configuration (layers, heads, K/V heads, head width, batch, sequence
length, right padding, attention implementation, N), the sharded step equals one device; any
reduction of a sequence-sharded activation, along it or across it, is exact, and split where its
partial results combine.

Derandomized, so CI sees the same examples each run; AUTOSP_HYPOTHESIS_EXAMPLES=50 (and
AUTOSP_HYPOTHESIS_SEED=<int> for other draws) explores further."""

import os

import cases
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")


def _drawn(examples: int):
    """The same examples every run (``examples`` of them unless AUTOSP_HYPOTHESIS_EXAMPLES says)."""

    def wrap(test):
        return seed(int(os.environ.get("AUTOSP_HYPOTHESIS_SEED", 0)))(
            settings(
                max_examples=int(os.environ.get("AUTOSP_HYPOTHESIS_EXAMPLES", examples)),
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
            )(test)
        )

    return wrap


@st.composite
def configurations(draw):
    heads = draw(st.sampled_from([2, 3, 4, 6, 8]))
    L = draw(st.integers(3, 40))
    return {
        "world": draw(st.sampled_from([2, 4])),
        "layers": draw(st.integers(1, 2)),
        "heads": heads,
        "kv_heads": draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0])),
        "head_dim": draw(st.sampled_from([8, 16])),
        "b": draw(st.integers(1, 2)),
        "L": L,
        "pad": draw(st.integers(0, L - 2)),  # at least one valid label remains after the shift
        "attn": draw(st.sampled_from(["sdpa", "eager"])),
    }


@pytest.mark.slow
@_drawn(6)
@given(cfg=configurations())
def test_random_small_configurations_match_one_device(pools, cfg):
    for r in pools(cfg["world"]).run(cases.random_hf_exactness, cfg):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * abs(ref), (cfg, loss, ref)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, (cfg, worst)


@st.composite
def reductions(draw):
    op = draw(st.sampled_from(sorted(cases.REDUCTIONS_DRAWN)))
    dims = draw(st.sampled_from([None, (1,), (2,), (1, 2)]))
    if op == "prod" and dims is not None:
        dims = dims[:1]
    return {
        "op": op,
        "dims": dims,
        "keepdim": draw(st.booleans()),
        "world": draw(st.sampled_from([2, 4])),
        "L": draw(st.integers(3, 40)),
    }


@_drawn(10)
@given(spec=reductions())
def test_random_reductions_are_exact_and_split_where_they_can_be(pools, spec):
    """Any of 13 reductions over every element, the sequence, the features or both, kept dims or
    not, on 2 or 4 ranks and any length: exact against one device; nothing activation-sized is
    gathered where the reduction's partial results combine (sums, means, extrema, p-norms) or
    where it does not run along the sequence."""
    world = spec["world"]
    for r in pools(world).run(cases.drawn_reduction_exactness, spec["op"], spec["dims"], spec["keepdim"], spec["L"]):
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-5 * max(abs(ref), 1e-6), (spec, loss, ref)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, (spec, worst)
        along = spec["dims"] is None or 1 in spec["dims"]
        if cases.splits_along_sequence(spec["op"], spec["dims"]) or not along:
            assert not r["gathered"], spec
