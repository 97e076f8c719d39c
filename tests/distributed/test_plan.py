"""The sharding plan: every tensor covered exactly once per TP group, experts once per EP group."""

import math

import pytest

from minidsa.checkpoint.manifest import checkpoint_manifest
from minidsa.distributed import Parallelism, rank_bytes, shard_manifest


def test_tp_slices_tile_each_split_tensor_and_experts_are_owned_once():
    par = Parallelism(tp=2, ep=4)
    full = checkpoint_manifest("laptop")
    plan = shard_manifest("laptop", 2, 4)
    assert sorted(plan) == [0, 1, 2, 3]
    for name, (shape, _) in full.items():
        holders = [r for r in plan if name in plan[r]]
        if ".experts." in name:  # 32 experts over 4 EP ranks: 8 contiguous experts each
            e = int(name.split(".experts.")[1].split(".")[0])
            assert holders == [e // 8], name
            continue
        assert holders == [0, 1, 2, 3], name  # everything else lives in every TP group
        for group in ([0, 1], [2, 3]):  # the two TP ranks of a group tile the tensor
            parts = [plan[r][name] for r in group]
            assert sum(math.prod(b - a for a, b in p) for p in parts) in (math.prod(shape), 2 * math.prod(shape))
    # a column tensor is split by rows, a row tensor by columns, a norm replicated
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    o = "language_model.model.layers.0.self_attn.o_proj.weight"
    n = "language_model.model.layers.0.input_layernorm.weight"
    assert plan[1][q] == [[128, 256], [0, 256]] and plan[1][o] == [[0, 256], [128, 256]]
    assert plan[1][n] == plan[0][n] == [[0, 256]]
    assert par.expert_range(__import__("minidsa").load_config("laptop"), 3) == range(24, 32)


def test_rank_bytes_add_up_to_the_single_process_model():
    one = rank_bytes("laptop")[0]
    ep = rank_bytes("laptop", 1, 4)
    assert sum(r["experts"] for r in ep) == one["experts"]  # each expert on exactly one rank
    assert all(r["weights"] - r["experts"] == one["weights"] - one["experts"] for r in ep)
    tp = rank_bytes("laptop", 2, 1)
    assert tp[0]["kda_state_per_sequence"] * 2 == one["kda_state_per_sequence"]  # each rank: half the heads
    assert tp[0]["kv_per_token"] == one["kv_per_token"]  # latent rows are shared by all heads: whole
    assert one["experts"] < tp[0]["weights"] < one["weights"]


@pytest.mark.parametrize("tp,ep,match", [(3, 1, "tp=3 does not divide kda.num_heads=8"),
                                         (1, 5, "ep=5 does not divide moe.num_experts=32"),
                                         (2, 3, "multiple of the smaller"), (0, 1, "positive int")])
def test_bad_splits_name_the_fix(tp, ep, match):
    with pytest.raises(ValueError, match=match):
        rank_bytes("laptop", tp, ep)
