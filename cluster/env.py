"""Every ``KVRAY_*`` environment variable kvray reads, in one place. Each supplies the default
of the ``kvray serve`` flag named beside it; a flag on the command line wins."""

from __future__ import annotations

import os

ENV_DEFAULTS = {
    # variable: (serve flag, meaning)
    "KVRAY_MODEL": ("--model", "model directory (default: the embedded tiny model)"),
    "KVRAY_KV_CACHE_LAYOUT": ("--kv-cache-layout", "KV cache layout or alias"),
    "KVRAY_ATTENTION_BACKEND": ("--attention-backend", "torch or triton"),
    "KVRAY_KV_CACHE_MEMORY": ("--kv-cache-memory", "KV cache bytes per rank on CPU, e.g. 1GiB"),
    "KVRAY_PP_LAYER_PARTITION": ("--pp-layer-partition", "decoder layers per pipeline stage"),
    "KVRAY_HOST": ("--host", "address the gRPC server binds"),
    "KVRAY_PORT": ("--port", "gRPC port"),
    "KVRAY_API_KEY": ("--api-key", "require 'authorization: Bearer <key>'"),
    "KVRAY_LOG_LEVEL": ("--log-level", "logging level"),
}


def env_default(name: str, fallback=None):
    if name not in ENV_DEFAULTS:
        raise KeyError(f"{name} is not a kvray environment variable")
    value = os.environ.get(name)
    return fallback if value in (None, "") else value


def parse_bytes(text: str | int | None) -> int | None:
    """``"512MiB"``, ``"2G"``, ``"1048576"`` -> bytes."""
    if text is None or isinstance(text, int):
        return text
    units = {
        "": 1,
        "B": 1,
        "K": 10**3,
        "KB": 10**3,
        "KIB": 2**10,
        "M": 10**6,
        "MB": 10**6,
        "MIB": 2**20,
        "G": 10**9,
        "GB": 10**9,
        "GIB": 2**30,
        "T": 10**12,
        "TIB": 2**40,
    }
    cleaned = text.strip().upper().replace(" ", "")
    number = cleaned.rstrip("KMGTIB")
    unit = cleaned[len(number) :]
    try:
        return int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 2GiB or a byte count)") from None
