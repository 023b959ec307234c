"""Reductions of sequence-sharded activations whose partial results do not add: a maximum, a
minimum, a p-norm. Each rank reduces its own shard and the partial results are combined as
such (all-reduce MAX / MIN; the p-th powers summed, then the root), so the step is exact and
nothing activation-sized is gathered. Before, the partial maxima and norms DTensor's strategies
produce were summed: a loss of 4.08 where one device gives 2.04 (``h.abs().max()``, 2 ranks).
Partial results autosp cannot reduce exactly (a product) are refused at the rule: the op then
reads its input whole, gathered, and stays exact."""

import cases
import pytest
from _checks import assert_exact, assert_matmuls_split


@pytest.mark.parametrize(
    "kind,reduced",
    [
        ("max", "P(max)"),
        ("min", "P(min)"),
        ("amax", "P(max)"),
        ("amax_seq", "P(max)"),
        ("amin_seq_keepdim", "P(min)"),
        ("max_ties", "P(max)"),
        ("vector_norm_seq", "_NormP(2)"),
        ("norm", "_NormP(2)"),
        ("vector_norm_3_seq", "_NormP(3)"),
    ],
)
def test_non_additive_reductions_match_one_device_and_gather_nothing(pools, kind, reduced):
    """Exact (ties at the maximum included, within and across ranks: the gradient is shared among
    them as one device shares it), and split: the partial result is all-reduced as its own kind, and no
    activation is all-gathered."""
    results = pools(2).run(cases.reduction_exactness, kind, 2, 64)
    for r in results:
        assert_exact(r)
        assert ("all_reduce", reduced) in r["collectives"], r["collectives"]
        assert not any(k == "all_gather" for k, _ in r["collectives"]), r["collectives"]
    assert_matmuls_split(results, 64)


@pytest.mark.parametrize(
    "kind",
    [
        "logsumexp_seq",
        "std_seq",
        "var_seq_keepdim",
        "max_dim_seq",
        "min_dim_seq_keepdim_ties",
        "max_dim_ties",
        "max_dim_flat_tokens",
        "cumsum_seq",
        "logcumsumexp_seq",
        "reverse_cumsum_seq",
        "prod_seq",
    ],
)
def test_reductions_along_the_sequence_merge_the_ranks_results(pools, kind):
    """Each rank's result for its own rows, all-gathered (reduced-sized) and merged: log-sum-exps
    by a log-sum-exp, variances and standard deviations by Chan's formula from each rank's
    (count, mean, sum of squared deviations), ``max(dim)`` / ``argmin(dim)`` from each rank's
    (value, global index), the first index winning ties within and across ranks as on one
    device, the gradient scattered into the winner's row on its rank; running sums and
    log-sum-exps from the totals of the ranks before (their backward flips the gradient along
    the sequence: an exchange with the mirrored ranks); a product by a product (its backward: a
    shift, running products and flips). Exact, and the activation is never
    gathered. On 4 ranks with 3 tokens one rank holds none: it offers no candidate, a sum or
    product of nothing, or a scan's empty total (the kinds with such a path)."""
    geometries = [(4, 45)]
    if kind in ("logsumexp_seq", "std_seq", "var_seq_keepdim"):
        geometries.append((2, 64))  # an even split, as these were first tested
    if kind in ("max_dim_seq", "cumsum_seq", "logsumexp_seq", "std_seq", "prod_seq"):
        geometries.append((4, 3))
    for world, L in geometries:
        results = pools(world).run(cases.reduction_exactness, kind, 2, L)
        seq = "_S(0, 2)" if "flat" in kind else "S(1)"  # (b, L) flattened: each sequence's rows
        for r in results:
            assert_exact(r)
            assert ("merge", seq) in r["collectives"], r["collectives"]
            assert not any(k in ("all_gather", "all_to_all") for k, _ in r["collectives"]), r["collectives"]
            # the selection's gradient is scattered on the rank holding the row, not whole on each
            assert r["scatters"] == ([seq] if "_dim_" in kind else []), r["scatters"]
        assert_matmuls_split(results, L)


@pytest.mark.parametrize("kind", ["prod", "cumprod_seq"])
def test_products_that_read_their_input_whole_stay_exact(pools, kind):
    """A product of every element (DTensor's strategy offers a partial product, which autosp does
    not reduce: refused at the rule) runs on its input whole, and so does a running product's
    backward (torch's formula picks rows by index along the sequence): exact, with an
    all-gather, and no partial product ever reduced by summing."""
    results = pools(2).run(cases.reduction_exactness, kind, 2, 64)
    assert_matmuls_split(results, 64)  # the layers before the product still split
    for r in results:
        assert_exact(r)
        assert all(src in ("P(sum)", "S(1)", "_S(0, 2)") for _, src in r["collectives"]), r["collectives"]


def test_max_over_an_uneven_split_on_4_ranks(pools):
    """45 tokens over 4 ranks (12, 11, 11, 11): the maximum and a p-norm stay exact."""
    for kind in ("max", "vector_norm_seq"):
        for r in pools(4).run(cases.reduction_exactness, kind, 1, 45):
            assert_exact(r)
