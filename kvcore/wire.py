"""msgspec wire format for everything kvcore sends between processes.

Specs travel as a tagged union (the tag is the class name under the key ``"type"``), so the
receiver gets back exactly the class that was sent. The encoding is MessagePack; a Fraction
travels as its ``"p/q"`` string and is turned back into a Fraction by the spec on arrival.
Anything that does not decode cleanly raises ``WireFormatError``.
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache
from typing import Any, TypeVar

import msgspec

from kvcore.errors import WireFormatError
from kvcore.geometry import KVCacheTensor
from kvcore.layout import KVCacheLayout
from kvcore.spec_base import KVCacheSpec
from kvcore.uniform_spec import AnyKVCacheSpec

T = TypeVar("T")


class RankReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker tells the controller at startup."""

    rank: int
    # Layer name -> this rank's spec, in layer order.
    specs: dict[str, AnyKVCacheSpec]
    # Layout names the rank's attention backend can serve, most preferred first.
    supported_layouts: list[str]
    # Bytes this rank can give to its KV cache.
    free_memory_bytes: int

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"RankReport.rank must be >= 0, got {self.rank}")
        if self.free_memory_bytes < 0:
            raise ValueError(
                f"RankReport.free_memory_bytes must be >= 0, got {self.free_memory_bytes}"
            )
        for name in self.supported_layouts:
            KVCacheLayout.parse(name)


def _encode_extra(obj: Any) -> Any:
    if isinstance(obj, Fraction):
        return str(obj)
    raise NotImplementedError(f"kvcore's wire format cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)


def encode(message: KVCacheSpec | KVCacheTensor | RankReport | Any) -> bytes:
    """Encode a spec, a ``KVCacheTensor``, a ``RankReport`` or a list/dict of them."""
    try:
        return _encoder.encode(message)
    except (TypeError, NotImplementedError) as exc:
        raise WireFormatError(f"Cannot encode {type(message).__name__}: {exc}") from exc


@cache
def _decoder(message_type: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(message_type)


def decode(data: bytes, message_type: type[T] | Any) -> T:
    """Decode ``data`` as ``message_type``; any failure raises ``WireFormatError``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireFormatError(f"Expected bytes to decode, got {type(data).__name__}")
    try:
        return _decoder(message_type).decode(data)
    except (msgspec.MsgspecError, ValueError, TypeError, ArithmeticError) as exc:
        name = getattr(message_type, "__name__", str(message_type))
        raise WireFormatError(f"Malformed {name} message: {exc}") from exc


def decode_spec(data: bytes) -> KVCacheSpec:
    return decode(data, AnyKVCacheSpec)


def decode_kv_cache_tensor(data: bytes) -> KVCacheTensor:
    return decode(data, KVCacheTensor)


def decode_rank_report(data: bytes) -> RankReport:
    return decode(data, RankReport)
