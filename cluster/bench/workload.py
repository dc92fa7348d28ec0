"""Benchmark requests: random token ids with lengths drawn from ranges, from a fixed seed."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


def random_requests(
    num: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    *,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            prompt=[rng.randrange(vocab_size) for _ in range(rng.randint(*input_range))],
            max_tokens=rng.randint(*output_range),
        )
        for _ in range(num)
    ]


def shared_prefix_requests(
    num: int, prefix_len: int, suffix_len: int, output_len: int, *, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """Every prompt starts with the same ``prefix_len`` tokens (``prefix_len = 0``: none)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [
        BenchRequest(
            prompt=prefix + [rng.randrange(vocab_size) for _ in range(suffix_len)],
            max_tokens=output_len,
        )
        for _ in range(num)
    ]


def multi_tenant_requests(
    num: int,
    num_tenants: int,
    system_prompt_len: int,
    user_range: tuple[int, int],
    output_range: tuple[int, int],
    *,
    vocab_size: int,
    seed: int = 0,
) -> list[tuple[int, BenchRequest]]:
    """Chat traffic of several applications: ``num_tenants`` system prompts of
    ``system_prompt_len`` tokens, each request one of them (drawn at random) followed by its
    own user turn. Returns (tenant, request) pairs."""
    rng = random.Random(seed)
    systems = [
        [rng.randrange(vocab_size) for _ in range(system_prompt_len)] for _ in range(num_tenants)
    ]
    pairs = []
    for _ in range(num):
        tenant = rng.randrange(num_tenants)
        user = [rng.randrange(vocab_size) for _ in range(rng.randint(*user_range))]
        pairs.append(
            (
                tenant,
                BenchRequest(prompt=systems[tenant] + user, max_tokens=rng.randint(*output_range)),
            )
        )
    return pairs


def ideal_cached_tokens(tenants: list[int], system_prompt_len: int, block_size: int) -> int:
    """The prompt tokens a cache that never evicts would serve: every request after a
    tenant's first hits its system prompt's whole blocks."""
    repeats = len(tenants) - len(set(tenants))
    return repeats * (system_prompt_len // block_size) * block_size


def parse_range(text: str) -> tuple[int, int]:
    """``"32-256"`` or ``"64"`` -> (low, high)."""
    low, _, high = text.partition("-")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"not a length range: {text!r} (use e.g. 32-256)")
    return bounds


def parse_lengths(text: str) -> list[int]:
    """``"256,4096"`` -> [256, 4096]."""
    lengths = [int(part) for part in text.split(",") if part.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"not a list of lengths: {text!r} (use e.g. 256,4096)")
    return lengths
