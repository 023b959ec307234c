"""Communication and work, counted independently of autosp's own bookkeeping: torch.profiler's
gloo events (what gloo actually ran) and FLOP counts, on real 2-rank gloo groups."""

from collections import Counter

import cases
import pytest
from _checks import tier

LAYERS = 2  # examples.models.LlamaConfig's default


def _bytes(events):
    return sum(numel * 4 for _, numel in events)  # every tensor in these models is fp32


@pytest.mark.parametrize(
    "kind,b",
    tier([("llama", 1), ("llama", 2), ("llama_manual", 1), ("llama_mha", 1)], [("llama", 2)]),
)
def test_gloo_traffic_is_at_most_hand_written_ulysses(pools, kind, b):
    """Catches an all-gather or reduce-scatter of an activation, an extra all-to-all, or K/V sent
    at the query head count: per rank and step, autosp's gloo bytes <= hand-written Ulysses'."""
    r = pools(2).run(cases.comm, kind, b, 96)[0]
    auto, uly = Counter(n for n, _ in r["autosp"]), Counter(n for n, _ in r["ulysses"])
    assert auto["gloo:all_to_all"] == 8 * LAYERS == uly["gloo:all_to_all"]
    assert set(auto) <= {"gloo:all_to_all", "gloo:all_reduce"}, auto
    assert _bytes(r["autosp"]) <= _bytes(r["ulysses"])
    # parameter gradients are all-reduced in flat buckets, not one collective per parameter
    assert auto["gloo:all_reduce"] <= 2 < uly["gloo:all_reduce"]
    # the profiler and the plan agree on the all-to-alls that ran
    assert sum(1 for kind, _, _ in r["plan"] if kind == "all_to_all") == auto["gloo:all_to_all"]
    # the input check adds two all-gathers of a few integers (the count, then 3 per input tensor)
    extra = Counter(r["autosp_checked"]) - Counter(r["autosp"])
    assert extra == Counter({("gloo:all_gather", 1): 1, ("gloo:all_gather", 2 * 3): 1}), extra


@pytest.mark.parametrize("world", tier([2, 4], [2]))
def test_work_and_saved_activations_are_split(pools, world):
    """Per rank, a step's matmul FLOPs and the activations kept for backward are about 1/N of
    the single-device step's."""
    r = pools(world).run(cases.work, "llama", 1, 192)[0]
    flops, single = r["flops"]
    assert flops / single == pytest.approx(1 / world, rel=0.05)
    saved, saved_single = r["saved"]
    assert saved / saved_single <= 1.15 / world
