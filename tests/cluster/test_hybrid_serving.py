"""A Mamba-2 hybrid (NemotronH) served end to end through the gRPC client, with the default
flags: its prefix cache hits at the last kept state (every 128 tokens) of a shared prefix, also
when the first request's steps ended in its own tokens, and the tokens stay transformers'."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.client import AsyncClient, Client
from cluster.config import EngineConfig
from cluster.local import LocalServer
from tests.workers.hf_models import reference_generations, save_nemotron_h


def tokens(count: int, step: int, offset: int) -> list[int]:
    """Ids from 3 up: transformers' generate takes the tiny model's pad id (0) in a prompt for
    padding, and 1 and 2 are its BOS and EOS."""
    return [3 + (step * i + offset) % 297 for i in range(count)]


SHARED = tokens(300, 7, 3)
FIRST = SHARED + tokens(100, 11, 5)  # 400 tokens
SECOND = SHARED + tokens(50, 13, 1)  # 350 tokens
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_nemotron_h(tmp_path_factory.mktemp("nemotron_h"), "M*-M-", 2)


@pytest.fixture(scope="module")
def expected(model_dir):
    return reference_generations(model_dir, [FIRST, SECOND], NUM_TOKENS)


def run_pair(model_dir, **settings):
    """Both prompts one after the other on a fresh server; their completions and the server
    info after them."""
    config = EngineConfig(model=str(model_dir), port=0, kv_cache_memory_bytes=64 << 20, **settings)
    with LocalServer(config) as server, Client(server.address, timeout=120) as client:
        first = client.generate(FIRST, max_tokens=NUM_TOKENS, temperature=0)
        second = client.generate(SECOND, max_tokens=NUM_TOKENS, temperature=0)
        return first, second, client.info()


def group_hits(info) -> dict[str, int]:
    return {
        group["spec_type"]: group.get("prefix_cache_group_hit_tokens", 0)
        for group in info["groups"]
    }


def test_a_300_token_shared_prefix_hits_at_its_last_state_boundary(model_dir, expected):
    first, second, info = run_pair(model_dir)
    assert first.usage.cached_prompt_tokens == 0
    assert second.usage.cached_prompt_tokens == 256  # the states kept at 128 and 256
    assert [first.token_ids, second.token_ids] == expected
    assert info["prefix_cache_queried_tokens"] == len(FIRST) + len(SECOND)
    assert info["prefix_cache_hit_tokens"] == 256
    assert group_hits(info) == {"FullAttentionSpec": 256, "MambaSpec": 256}
    assert info["num_free_blocks"] == info["num_blocks"] - 1  # every block came back


def test_a_first_request_whose_steps_end_in_its_own_tokens_still_shares_its_prefix(
    model_dir, expected
):
    # Steps of at most 384 tokens: the first prompt runs as 384 + 16, so its only step end
    # on the 128-token grid (384) is in its own tokens; the states at 128 and 256 were
    # checkpointed on the way.
    first, second, _ = run_pair(model_dir, max_num_batched_tokens=384)
    assert second.usage.cached_prompt_tokens == 256
    assert [first.token_ids, second.token_ids] == expected


def test_without_prefix_caching_nothing_is_cached_and_the_tokens_are_the_same(model_dir, expected):
    first, second, info = run_pair(model_dir, enable_prefix_caching=False)
    assert second.usage.cached_prompt_tokens == 0
    assert [first.token_ids, second.token_ids] == expected
    assert info["prefix_cache_hit_tokens"] == 0


def test_preempted_and_aborted_requests_free_their_states_and_keep_their_tokens(model_dir):
    """Four 100-token prompts asking for 60 tokens each, sent at once, in a pool of 22 blocks:
    one request at its full length holds 12, so any two running together outgrow it and
    one is preempted and recomputes (resuming from its own kept states where it can); their
    tokens are still transformers', an aborted stream frees its blocks, and every block comes
    back."""
    prompts = [tokens(100, 7 + 2 * i, i) for i in range(4)]
    expected = reference_generations(model_dir, prompts, 60)
    config = EngineConfig(
        model=str(model_dir),
        port=0,
        kv_cache_memory_bytes=64 << 20,
        num_gpu_blocks_override=22,  # about what the planner takes for one 192-token request
        max_model_len=192,
        max_num_batched_tokens=256,
    )

    async def all_at_once(address: str):
        async with AsyncClient(address, timeout=120) as client:
            calls = [client.generate(p, max_tokens=60, temperature=0) for p in prompts]
            return await asyncio.gather(*calls)

    with LocalServer(config) as server, Client(server.address, timeout=120) as client:
        results = asyncio.run(all_at_once(server.address))
        stream = client.stream(prompts[0], max_tokens=40, temperature=0, ignore_eos=True)
        next(stream)
        stream.close()  # the client goes away mid-stream: the server aborts the request
        scheduler = server.engine.scheduler
        assert scheduler.num_preemptions > 0
        deadline = time.monotonic() + 30
        while scheduler.running and time.monotonic() < deadline:
            time.sleep(0.1)
        info = client.info()
    assert [r.token_ids for r in results] == expected
    assert info["num_running_requests"] == 0
    assert info["num_free_blocks"] == info["num_blocks"] - 1
