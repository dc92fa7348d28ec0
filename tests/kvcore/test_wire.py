"""msgspec round trips for every class, and clear errors for bytes that are not a message."""

from __future__ import annotations

import contextlib
from fractions import Fraction

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    RankReport,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    WireFormatError,
    decode,
    decode_kv_cache_tensor,
    decode_rank_report,
    decode_spec,
    encode,
)

ATTN = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")

EVERY_SPEC = [
    AttentionSpec(**ATTN, kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD, state_content_bytes=136),
    FullAttentionSpec(**ATTN, sliding_window=128, non_causal=True, page_size_padded=8192),
    FullAttentionSpec(**{**ATTN, "dtype": "float8_e4m3fn"}, tokens_per_state=Fraction(1, 4)),
    FullAttentionSpec(**ATTN, tokens_per_state=Fraction(4, 1)),
    MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype="uint8",
        state_content_bytes=656,
        alignment=4096,
        cache_dtype_str="fp8_ds_mla",
    ),
    SlidingWindowSpec(**ATTN, sliding_window=4096, extra_retained_tokens=3),
    SlidingWindowMLASpec(
        block_size=16,
        num_kv_heads=1,
        head_size=64,
        dtype="float16",
        sliding_window=128,
        model_version="deepseek_v4",
        tokens_per_state=4,
    ),
    ChunkedLocalAttentionSpec(**{**ATTN, "dtype": "float32"}, attention_chunk_size=512),
    CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=8, head_size_v=0, dtype="int8"),
    MambaSpec(
        block_size=16,
        shapes=((4, 8), (2,)),
        dtypes=("float32", "bfloat16"),
        mamba_cache_mode="align",
        num_speculative_blocks=1,
        tp_replicated=True,
    ),
    UniformTypeKVCacheSpecs(
        block_size=16,
        kv_cache_specs={
            "main": FullAttentionSpec(**ATTN),
            "comp": MLAAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=16, dtype="bfloat16", tokens_per_state=4
            ),
        },
    ),
]


@pytest.mark.parametrize("spec", EVERY_SPEC, ids=lambda s: type(s).__name__)
def test_every_spec_round_trips_exactly(spec):
    decoded = decode_spec(encode(spec))
    assert type(decoded) is type(spec)
    assert decoded == spec
    assert type(decoded.block_size) is int
    for name in type(spec).__struct_fields__:
        assert type(getattr(decoded, name)) is type(getattr(spec, name)), name
    assert decoded.page_size_bytes == spec.page_size_bytes


def test_fraction_and_int_tokens_per_state_keep_their_types():
    fraction = decode_spec(encode(EVERY_SPEC[2]))
    assert fraction.tokens_per_state == Fraction(1, 4)
    assert type(fraction.tokens_per_state) is Fraction
    whole_fraction = decode_spec(encode(EVERY_SPEC[3]))
    assert type(whole_fraction.tokens_per_state) is Fraction
    plain = decode_spec(encode(FullAttentionSpec(**ATTN, tokens_per_state=4)))
    assert type(plain.tokens_per_state) is int


def test_kv_cache_tensor_round_trips():
    tensor = KVCacheTensor(
        size=65_280, layers=["m0", "m1", "m2"], layer_stride=2048, block_stride=6528, offset=6144
    )
    decoded = decode_kv_cache_tensor(encode(tensor))
    assert decoded == tensor
    assert decoded.layers == ["m0", "m1", "m2"]


def test_rank_report_round_trips_in_layer_order():
    specs = {f"model.layers.{i}.attn": EVERY_SPEC[i % 3] for i in range(6)}
    specs["model.layers.6.ssm"] = EVERY_SPEC[9]
    report = RankReport(
        rank=1, specs=specs, supported_layouts=["LBNHC", "BLHNC"], free_memory_bytes=123_456_789_012
    )
    decoded = decode_rank_report(encode(report))
    assert decoded == report
    assert list(decoded.specs) == list(specs)


def test_lists_of_messages_round_trip():
    data = encode(EVERY_SPEC)
    assert (
        decode(
            data,
            list[
                AttentionSpec
                | MambaSpec
                | UniformTypeKVCacheSpecs
                | FullAttentionSpec
                | MLAAttentionSpec
                | SlidingWindowSpec
                | SlidingWindowMLASpec
                | ChunkedLocalAttentionSpec
                | CircularBufferSpec
            ],
        )
        == EVERY_SPEC
    )


GOOD = encode(EVERY_SPEC[1])


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x00\x01\x02",
        GOOD[:-1],
        GOOD[: len(GOOD) // 2],
        msgspec.msgpack.encode({"type": "NoSuchSpec", "block_size": 16}),
        msgspec.msgpack.encode({"type": "FullAttentionSpec", "block_size": "16"}),
        msgspec.msgpack.encode({"type": "FullAttentionSpec", "block_size": 16}),
        msgspec.msgpack.encode({**msgspec.to_builtins(EVERY_SPEC[1]), "dtype": "float64"}),
        msgspec.msgpack.encode({**msgspec.to_builtins(EVERY_SPEC[1]), "num_kv_heads": -2}),
        msgspec.msgpack.encode({**msgspec.to_builtins(EVERY_SPEC[1]), "tokens_per_state": "x"}),
        msgspec.msgpack.encode({**msgspec.to_builtins(EVERY_SPEC[1]), "tokens_per_state": "1/0"}),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.json.encode(msgspec.to_builtins(EVERY_SPEC[0])),
    ],
)
def test_garbage_and_truncated_bytes_raise_the_clear_error(data):
    with pytest.raises(WireFormatError, match="Malformed"):
        decode_spec(data)


def test_malformed_reports_and_tensors_raise_the_clear_error():
    bad_layout = msgspec.msgpack.encode(
        {"rank": 0, "specs": {}, "supported_layouts": ["XYZ"], "free_memory_bytes": 1}
    )
    with pytest.raises(WireFormatError, match="XYZ"):
        decode_rank_report(bad_layout)
    negative = msgspec.msgpack.encode(
        {"rank": -1, "specs": {}, "supported_layouts": [], "free_memory_bytes": 1}
    )
    with pytest.raises(WireFormatError, match="rank"):
        decode_rank_report(negative)
    with pytest.raises(WireFormatError):
        decode_kv_cache_tensor(msgspec.msgpack.encode([10, [], 1, 1, 0]))
    with pytest.raises(WireFormatError, match="Expected bytes"):
        decode_spec("not bytes")


def test_unencodable_objects_raise_the_clear_error():
    with pytest.raises(WireFormatError, match="object"):
        encode(object())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_escape_as_another_error(data):
    with contextlib.suppress(WireFormatError):
        decode_spec(data)
    with contextlib.suppress(WireFormatError):
        decode_rank_report(data)


@settings(max_examples=300, deadline=None)
@given(
    spec_index=st.integers(0, len(EVERY_SPEC) - 1),
    position=st.integers(0, 10_000),
    byte=st.integers(0, 255),
)
def test_corrupted_messages_decode_or_raise_the_clear_error(spec_index, position, byte):
    data = bytearray(encode(EVERY_SPEC[spec_index]))
    data[position % len(data)] = byte
    with contextlib.suppress(WireFormatError):
        decode_spec(bytes(data))
