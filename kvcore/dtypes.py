"""KV-cache element types by name, and the quantisation modes a cache may use.

Specs carry dtype *names* rather than torch dtypes so that the controller and the Python client
can plan and decode specs without importing torch.
"""

from __future__ import annotations

import enum
from typing import Literal

from kvcore.errors import KVCacheSpecError

DTypeName = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8"]

# The dtypes a model's weights (and so its activations) may take; the cache takes any of
# DTYPE_SIZES'.
MODEL_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_size(name: str) -> int:
    """Bytes per element of the named dtype."""
    try:
        return DTYPE_SIZES[name]
    except KeyError:
        raise KVCacheSpecError(
            f"Unknown KV cache dtype {name!r}. Valid dtypes: {sorted(DTYPE_SIZES)}"
        ) from None


class KVQuantMode(enum.IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5
    TURBOQUANT_K8V4 = 6
    TURBOQUANT_4BIT_NC = 7
    TURBOQUANT_K3V4_NC = 8
    TURBOQUANT_3BIT_NC = 9
    NVFP4_DS_MLA = 10

    @property
    def is_per_token_head(self) -> bool:
        return self in _PER_TOKEN_HEAD

    @property
    def is_nvfp4(self) -> bool:
        return self in (KVQuantMode.NVFP4, KVQuantMode.NVFP4_DS_MLA)

    @property
    def is_turboquant(self) -> bool:
        return self.name.startswith("TURBOQUANT_")


_PER_TOKEN_HEAD = frozenset(
    {
        KVQuantMode.INT8_PER_TOKEN_HEAD,
        KVQuantMode.FP8_PER_TOKEN_HEAD,
        KVQuantMode.INT4_PER_TOKEN_HEAD,
    }
)


def get_kv_quant_mode(cache_dtype: str) -> KVQuantMode:
    """Map a ``--kv-cache-dtype`` string to its quantisation mode.

    The order matters: exact per-token-head names first, then ``nvfp4_ds_mla`` before the
    general ``nvfp4`` prefix, then the TurboQuant family, then any ``fp8`` string.
    """
    exact = {
        "int4_per_token_head": KVQuantMode.INT4_PER_TOKEN_HEAD,
        "int8_per_token_head": KVQuantMode.INT8_PER_TOKEN_HEAD,
        "fp8_per_token_head": KVQuantMode.FP8_PER_TOKEN_HEAD,
        "nvfp4_ds_mla": KVQuantMode.NVFP4_DS_MLA,
    }
    if cache_dtype in exact:
        return exact[cache_dtype]
    if cache_dtype.startswith("nvfp4"):
        return KVQuantMode.NVFP4
    if cache_dtype.startswith("turboquant_"):
        return KVQuantMode[cache_dtype.upper()]
    if cache_dtype.startswith("fp8"):
        return KVQuantMode.FP8_PER_TENSOR
    return KVQuantMode.NONE


def is_quantized_kv_cache(cache_dtype: str) -> bool:
    return get_kv_quant_mode(cache_dtype) != KVQuantMode.NONE
