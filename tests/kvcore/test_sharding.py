"""Tensor-parallel sharding of layer geometry, and the cross-rank agreement check."""

from __future__ import annotations

import msgspec
import pytest

from kvcore import (
    FullAttentionSpec,
    GeometryMismatchError,
    MambaSpec,
    MLAAttentionSpec,
    RankReport,
    SlidingWindowSpec,
    TensorParallelError,
    check_rank_reports,
    decode_rank_report,
    encode,
    kv_head_range,
    shard_kv_cache_spec,
    shard_layer_specs,
)

GQA = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")


@pytest.mark.parametrize(("tp", "heads"), [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_kv_heads_split_when_divisible(tp, heads):
    for rank in range(tp):
        shard = shard_kv_cache_spec(GQA, tp, rank)
        assert shard.num_kv_heads == heads
        assert shard.page_size_bytes == GQA.page_size_bytes // tp
        assert shard.head_size == GQA.head_size and shard.block_size == GQA.block_size
    assert [list(kv_head_range(8, tp, r)) for r in range(tp)] == [
        list(range(r * heads, (r + 1) * heads)) for r in range(tp)
    ]


def test_kv_heads_replicated_when_fewer_than_ranks():
    mqa = msgspec.structs.replace(GQA, num_kv_heads=2)
    shards = [shard_kv_cache_spec(mqa, 8, rank) for rank in range(8)]
    assert all(s.num_kv_heads == 1 for s in shards)
    # Ranks 0-3 hold head 0, ranks 4-7 head 1.
    assert [kv_head_range(2, 8, r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(("heads", "tp"), [(6, 4), (3, 2), (4, 6)])
def test_indivisible_heads_are_refused_with_the_numbers(heads, tp):
    spec = msgspec.structs.replace(GQA, num_kv_heads=heads)
    with pytest.raises(TensorParallelError) as info:
        shard_kv_cache_spec(spec, tp, 0)
    assert f"num_kv_heads={heads}" in str(info.value)
    assert f"tensor parallel size {tp}" in str(info.value)


def test_layer_name_is_named_in_sharding_errors():
    spec = msgspec.structs.replace(GQA, num_kv_heads=3)
    with pytest.raises(TensorParallelError, match=r"Layer 'model\.layers\.5\.attn'"):
        shard_layer_specs({"model.layers.4.attn": GQA, "model.layers.5.attn": spec}, 2, 1)


@pytest.mark.parametrize(("tp", "rank"), [(0, 0), (2, 2), (2, -1)])
def test_bad_tp_size_or_rank_is_refused(tp, rank):
    with pytest.raises(TensorParallelError):
        shard_kv_cache_spec(GQA, tp, rank)


def test_sliding_window_fields_survive_sharding():
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype="float16", sliding_window=512
    )
    assert shard_kv_cache_spec(swa, 2, 1) == msgspec.structs.replace(swa, num_kv_heads=2)


def test_mla_latent_head_is_whole_on_every_rank():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16")
    assert all(shard_kv_cache_spec(mla, 8, r) == mla for r in range(8))
    bad = MLAAttentionSpec(block_size=16, num_kv_heads=2, head_size=576, dtype="bfloat16")
    with pytest.raises(TensorParallelError, match="one latent head"):
        shard_kv_cache_spec(bad, 2, 0)


GDN = MambaSpec(block_size=16, shapes=((8, 64), (16, 4, 32)), dtypes=("bfloat16", "float32"))


def test_mamba_state_splits_along_its_head_axis():
    shard = shard_kv_cache_spec(GDN, 4, 3)
    assert shard.shapes == ((2, 64), (4, 4, 32))
    assert shard.dtypes == GDN.dtypes
    assert shard.page_size_bytes * 4 == GDN.page_size_bytes
    other_axes = shard_kv_cache_spec(GDN, 2, 0, state_head_axes=(1, -1))
    assert other_axes.shapes == ((8, 32), (16, 4, 16))


def test_replicated_mamba_state_is_whole_on_every_rank():
    ple = MambaSpec(block_size=16, shapes=((24,),), dtypes=("bfloat16",), tp_replicated=True)
    assert all(shard_kv_cache_spec(ple, 4, r) == ple for r in range(4))


def test_indivisible_mamba_state_is_refused():
    with pytest.raises(TensorParallelError, match=r"shape \(8, 64\).*8 entries.*tp_replicated"):
        shard_kv_cache_spec(GDN, 16, 0)
    with pytest.raises(TensorParallelError, match="no axis 2"):
        shard_kv_cache_spec(GDN, 2, 0, state_head_axes=(2, 0))


GLOBAL = {
    "model.layers.0.attn": GQA,
    "model.layers.1.attn": SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=256
    ),
    "model.layers.2.ssm": GDN,
}


def reports_for(tp: int, global_specs=GLOBAL) -> list[RankReport]:
    """What honest workers would send, through the real wire format."""
    return [
        decode_rank_report(
            encode(
                RankReport(
                    rank=rank,
                    specs=shard_layer_specs(global_specs, tp, rank),
                    supported_layouts=["LBNHC", "BLHNC"],
                    free_memory_bytes=1 << 30,
                )
            )
        )
        for rank in range(tp)
    ]


def test_agreeing_ranks_pass_and_return_the_rank_specs():
    agreed = check_rank_reports(reports_for(2), GLOBAL, 2)
    assert agreed == shard_layer_specs(GLOBAL, 2, 0)
    assert agreed["model.layers.0.attn"].num_kv_heads == 4


def test_a_rank_with_the_wrong_head_count_is_named():
    reports = reports_for(4)
    wrong = msgspec.structs.replace(GQA, num_kv_heads=4)  # rank 2 forgot to shard
    reports[2] = msgspec.structs.replace(
        reports[2], specs={**reports[2].specs, "model.layers.0.attn": wrong}
    )
    with pytest.raises(GeometryMismatchError) as info:
        check_rank_reports(reports, GLOBAL, 4)
    error = info.value
    assert (error.rank, error.layer, error.field) == (2, "model.layers.0.attn", "num_kv_heads")
    assert (error.expected, error.reported) == (2, 4)
    for fragment in ("rank 2", "model.layers.0.attn", "num_kv_heads", "expected 2", "reported 4"):
        assert fragment in str(error)


def test_mismatched_state_shape_type_and_layers_are_named():
    reports = reports_for(2)
    unsharded = {**reports[1].specs, "model.layers.2.ssm": GDN}
    reports[1] = msgspec.structs.replace(reports[1], specs=unsharded)
    with pytest.raises(GeometryMismatchError) as info:
        check_rank_reports(reports, GLOBAL, 2)
    assert (info.value.rank, info.value.field) == (1, "shapes")

    reports = reports_for(2)
    as_full = msgspec.structs.replace(GQA, num_kv_heads=4)
    reports[0] = msgspec.structs.replace(
        reports[0], specs={**reports[0].specs, "model.layers.1.attn": as_full}
    )
    with pytest.raises(GeometryMismatchError) as info:
        check_rank_reports(reports, GLOBAL, 2)
    assert (info.value.rank, info.value.layer, info.value.field) == (
        0,
        "model.layers.1.attn",
        "type",
    )

    reports = reports_for(2)
    missing = dict(reports[1].specs)
    del missing["model.layers.1.attn"]
    reports[1] = msgspec.structs.replace(reports[1], specs=missing)
    with pytest.raises(GeometryMismatchError) as info:
        check_rank_reports(reports, GLOBAL, 2)
    assert (info.value.rank, info.value.layer, info.value.field) == (
        1,
        "model.layers.1.attn",
        "layer",
    )


def test_missing_and_duplicate_ranks_are_refused():
    reports = reports_for(2)
    with pytest.raises(GeometryMismatchError) as info:
        check_rank_reports(reports[:1], GLOBAL, 2)
    assert (info.value.rank, info.value.field) == (1, "rank")
    with pytest.raises(GeometryMismatchError, match="duplicate"):
        check_rank_reports([reports[0], reports[0]], GLOBAL, 2)


def test_backend_customization_is_part_of_the_expected_geometry():
    def two_head_slots(spec):
        if isinstance(spec, FullAttentionSpec):
            return msgspec.structs.replace(spec, num_head_slots=2)
        return spec

    attn_only = {"model.layers.0.attn": GQA}
    honest = [
        RankReport(
            rank=r,
            specs={"model.layers.0.attn": two_head_slots(shard_kv_cache_spec(GQA, 2, r))},
            supported_layouts=["LBNHC"],
            free_memory_bytes=0,
        )
        for r in range(2)
    ]
    check_rank_reports(honest, attn_only, 2, customize_spec=two_head_slots)
    with pytest.raises(GeometryMismatchError) as info:
        check_rank_reports(honest, attn_only, 2)
    assert info.value.field == "num_head_slots"
