"""The profiling step: the largest step the engine will run, before the KV cache takes the
rest of the device, so its peak memory can be measured (see ``workers.memory``).

It runs through the same parts as serving (the model runner, the serving attention backend
over a paged cache, the sampler with top-k and top-p on), so every temporary a real step makes
is in the peak. The cache it writes is a scratch one, just big enough, unbound afterwards.
A decode step over the same requests follows it: on a GPU the kernels' decode variants (the
attention decode tile, MLA's and Mamba's decode kernels) compile then, not at the first
request served. It is smaller than the profiling step, so the peak stays the profile's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kernels.attention import AttentionBackend
from kvcore import KVCacheSpec, get_kv_cache_config_from_groups, get_kv_cache_groups
from kvcore._math import cdiv
from workers.group_step import StepLimits
from workers.kv_cache import allocate_kv_cache
from workers.protocol import NewRequest, RequestDelta, StepPlan, StepResult
from workers.runner import ModelRunner
from workers.sampling import SamplingParams

# Sampled rows use every filter, so the sort and its temporaries are in the peak.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)


def profile_request_lens(num_tokens: int, num_seqs: int, max_len: int) -> list[int]:
    """``num_tokens`` prompt tokens over ``min(num_seqs, num_tokens)`` requests: one as long
    as it may be (the largest attention), the others one token each (the most sampled rows)."""
    lens = [1] * max(1, min(num_seqs, num_tokens))
    remaining = num_tokens - len(lens)
    for index in range(len(lens)):
        extra = min(remaining, max_len - lens[index])
        lens[index] += extra
        remaining -= extra
    return lens


def run_profile_step(
    model,
    backend: AttentionBackend,
    specs: Mapping[str, KVCacheSpec],
    *,
    num_tokens: int,
    num_seqs: int,
    max_len: int,
    device: torch.device,
) -> int:
    """Run one step of ``num_tokens`` tokens over ``num_seqs`` requests, each of at most
    ``max_len`` tokens, all sampled, then a decode step over them; returns the bytes of the
    scratch KV cache they used."""
    lens = profile_request_lens(num_tokens, num_seqs, max_len)
    layout = backend.supported_kv_cache_layouts()[0]
    groups = get_kv_cache_groups(specs, layout)
    # Room for one decoded token after each prompt.
    blocks_per_group = [
        [cdiv(n + 1, g.kv_cache_spec.block_size) for n in lens] for g in groups
    ]  # [G][R]
    num_blocks = 1 + sum(sum(row) for row in blocks_per_group)  # block 0 is the null block
    config = get_kv_cache_config_from_groups(
        groups,
        0,
        layout,
        max_model_len=max(lens) + 1,
        max_num_batched_tokens=num_tokens,
        enable_prefix_caching=False,
        num_blocks_override=num_blocks,
    )
    layers = model.kv_cache_layers()
    scratch = allocate_kv_cache(config, layers, backend, device)
    try:
        # The serving limits, so every group's largest scratch is measured.
        runner = ModelRunner(model, backend, config, device, StepLimits(num_tokens, num_seqs))
        requests = _profile_requests(lens, blocks_per_group)
        _step_alone(runner, model, StepPlan(new_requests=requests))
        _step_alone(runner, model, StepPlan(deltas=_decode_deltas(requests, max_len)))
        return scratch.numel() * scratch.element_size()
    finally:
        for layer in layers.values():
            layer.kv_cache = None  # the real cache binds its own views later
        del scratch


def _step_alone(runner: ModelRunner, model, plan: StepPlan) -> None:
    """``plan`` on this rank's pipeline stage alone: zeros stand for the hidden states of the
    stage before, and token 0 for what the last stage samples."""
    stage = getattr(model, "stage", None)
    if stage is None or stage.is_whole:
        runner.execute(plan)
        return
    hidden = None
    if not stage.is_first:
        num_tokens = sum(e.num_new_tokens for e in (*plan.new_requests, *plan.deltas))
        weight = next(model.parameters())
        hidden = weight.new_zeros(num_tokens, model.config.hidden_size)
    if stage.is_last:
        runner.execute(plan, hidden)
        return
    runner.run_stage(plan, hidden)
    ids = [e.request_id for e in (*plan.new_requests, *plan.deltas)]
    runner.take_sampled(plan, StepResult(sampled=dict.fromkeys(ids, 0)))


def _decode_deltas(requests: list[NewRequest], max_len: int) -> list[RequestDelta]:
    """One more token for every profile request with room for it."""
    return [
        RequestDelta(
            request_id=r.request_id,
            new_block_ids=[[] for _ in r.block_ids],
            num_computed_tokens=r.num_new_tokens,
            num_new_tokens=1,
        )
        for r in requests
        if r.num_new_tokens < max_len
    ]


def _profile_requests(lens: list[int], blocks_per_group: list[list[int]]) -> list[NewRequest]:
    next_block = 1
    block_ids: list[list[list[int]]] = [[] for _ in lens]  # [R][G]
    for group_counts in blocks_per_group:
        for index, count in enumerate(group_counts):
            block_ids[index].append(list(range(next_block, next_block + count)))
            next_block += count
    return [
        NewRequest(
            request_id=f"profile-{index}",
            token_ids=[0] * length,
            sampling=PROFILE_SAMPLING,
            block_ids=block_ids[index],
            num_computed_tokens=0,
            num_new_tokens=length,
        )
        for index, length in enumerate(lens)
    ]
