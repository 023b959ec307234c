"""Dropout on sequence shards: each rank draws its own shard's mask. Reproducible for a given seed
and sp size; not the single-device masks (so not comparable to one device element by element):
what must hold is consistency across ranks, reproducibility, and a correct dropout op."""

import cases


def test_dropout_draws_per_rank_masks_reproducibly(pools):
    rs = pools(2).run(cases.dropout_run, 0.2)
    for r in rs:
        assert r["loss0"] == r["loss1"] and r["runs_differ"] == 0.0  # same seed, same step
        assert abs(r["loss0"] - r["loss_eval"]) > 1e-3  # dropout was applied
        assert r["next0"] == r["next1"]
        assert abs(r["mask_frac"] - 0.5) < 0.05 and r["scaled"] == [0.0, 2.0]  # keep 1-p, scale 1/(1-p)
    # one global loss and one gradient on every rank; the generator stays in step across ranks
    assert len({r["loss0"] for r in rs}) == 1 and len({r["grad_digest"] for r in rs}) == 1
    assert len({r["next0"] for r in rs}) == 1
    # ...while the ranks' masks differ (the same seed on every rank would repeat one pattern)
    assert len({r["mask_digest"] for r in rs}) == 2
