"""Pure tests: specs, placements, view groups and local shapes. No process group."""

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autosp.annotations._spec import parse_spec
from autosp.propagate._placement import (
    local_shape,
    parse_placement,
    placement_str,
    redistribute_kind,
    shard,
    transfer_bytes,
)
from autosp.propagate._rules import _locate, _view_groups


def test_einops_spec_names_the_sharded_dim():
    assert parse_spec("b s@sp d", 3) == Shard(1)
    assert parse_spec("b s d", 3) == Replicate()
    assert parse_spec("... s@sp d", 4) == Shard(2)
    assert parse_spec(Shard(0), 2) == Shard(0)


@pytest.mark.parametrize(
    "spec,msg",
    [("b s d", "names 3 dims but the tensor has 2"), ("b@sp s@sp", "shards 2 dims"), ("b s@tp", "mesh axis 'tp'")],
)
def test_bad_spec_errors_teach(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse_spec(spec, 2)


@pytest.mark.parametrize("p", [Shard(1), Replicate(), Partial(), _StridedShard(0, split_factor=4)])
def test_placement_strings_round_trip(p):
    assert parse_placement(placement_str(p)) == p


def test_strided_shard_is_canonical():
    assert shard(2, 1) == Shard(2)
    assert shard(0, 3) == _StridedShard(0, split_factor=3)


def test_view_groups_flatten_and_split():
    assert _view_groups([2, 96, 64], [192, 64]) == [([0, 1], [0]), ([2], [1])]
    assert _view_groups([1, 96, 64], [1, 96, 4, 16]) == [([0], [0]), ([1], [1]), ([2], [2, 3])]


def test_sequence_behind_batch_flattens_to_strided_shard():
    """(b=2, s@sp) viewed as (b*s): the shard lands on dim 0 with split factor b."""
    assert _locate([192, 64], [0], stride=2, n=2) == (0, 2)
    assert _locate([2, 96, 64], [0, 1], stride=2, n=2) == (1, 1)


def test_redistribute_kinds_and_bytes():
    assert redistribute_kind(Shard(1), Shard(2)) == "all_to_all"
    assert redistribute_kind(Shard(1), Replicate()) == "all_gather"
    assert redistribute_kind(Partial(), Replicate()) == "all_reduce"
    assert redistribute_kind(Partial(), Shard(0)) == "reduce_scatter"
    assert redistribute_kind(Replicate(), Shard(0)) == ""
    assert redistribute_kind(Replicate(), Partial()) is None
    assert transfer_bytes("all_to_all", 1024, 4) == 1024 / 4 * 3 / 4
    assert local_shape([2, 96, 64], Shard(1), 4) == [2, 24, 64]


def test_yaml_config_round_trips_and_rejects_unknown_keys(tmp_path):
    from autosp import load_config

    path = tmp_path / "autosp.yaml"
    path.write_text("mesh: {sp: 2}\nshard: {seq: {input_ids: 1}, compiler: aot_eager}\n")
    cfg = load_config(path)
    assert cfg.mesh == {"sp": 2} and cfg.shard == {"seq": {"input_ids": 1}, "compiler": "aot_eager"}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['sq'\] in config section 'shard'"):
        load_config("shard: {sq: true}")
