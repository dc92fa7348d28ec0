"""N-gram speculative decoding through the real engine (scheduler, coordinator, worker, gRPC):
greedy tokens equal transformers' for a dense Llama, an MLA DeepSeek and a NemotronH hybrid
(whose Mamba states roll back past rejected drafts) with drafts both accepted and rejected,
under chunked prefill, preemption and prefix hits (a hit on blocks a rejected draft once wrote
must hold the verified K/V, and a hybrid's hit the verified Mamba state), and a Llama GGUF
held in blocks, whose verification steps run through the C decoder layers;
stops inside accepted drafts end where plain decoding ends; TP 2 on Ray agrees, for the
hybrid too."""

from __future__ import annotations

import json

import pytest
import ray
import torch

from cluster.client import Client
from cluster.config import EngineConfig
from cluster.local import LocalServer
from tests.cluster.ray_helpers import generate_all
from tests.cluster.servers import RayServer
from tests.workers.hf_models import (
    COMMON,
    PROMPTS,
    VOCAB,
    reference_generations,
    save_deepseek,
    save_nemotron_h,
)
from tests.workers.test_gguf import ALL_QUANTIZED, write_gguf

SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
)
# Prompts that repeat themselves, so drafts come from the start; 40 outputs each.
REPEATING = [p + p for p in PROMPTS]
NUM_TOKENS = 40
# Weights this size make greedy outputs partly loop and partly wander: some drafts are
# accepted and some rejected, which is what these tests need (at 0.5 none are accepted).
INIT_RANGE = 0.1
HYBRID_LAYERS, HYBRID_INIT = "M-*M-", 0.1


def save_llama(directory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "initializer_range": INIT_RANGE})
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def saved(family: str, directory):
    """The checkpoint, transformers' outputs for REPEATING, and follow-up prompts (a prompt and
    20 of its outputs) with transformers' outputs for them."""
    reference = directory
    if family == "llama":
        save_llama(directory)
    elif family == "llama_gguf":
        reference = save_llama(directory / "hf")  # rewritten with the weights the file holds
        directory = directory / "model.gguf"
        write_gguf(reference, directory, ALL_QUANTIZED)
    elif family == "nemotron_h":
        # Two Mamba layers around the attention one: a state that kept a rejected draft
        # changes every later token.
        save_nemotron_h(directory, HYBRID_LAYERS, n_groups=2, initializer_range=HYBRID_INIT)
    else:
        save_deepseek(directory, q_lora_rank=24, initializer_range=INIT_RANGE)
    expected = reference_generations(reference, REPEATING, NUM_TOKENS)
    follow_ups = [p + out[:20] for p, out in zip(REPEATING, expected, strict=True)]
    return family, directory, expected, follow_ups, reference_generations(reference, follow_ups, 12)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return saved("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return saved("deepseek", tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    return saved("nemotron_h", tmp_path_factory.mktemp("nemotron_h"))


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    return saved("llama_gguf", tmp_path_factory.mktemp("llama_gguf"))


def c_decoder_steps(server: LocalServer) -> int:
    """Steps the in-process worker took through the C decoder layers."""
    return server.engine.transport.worker.model.model._cpu_decode.num_steps


@pytest.fixture(params=["llama", "deepseek", "nemotron_h", "llama_gguf"])
def model(request):
    return request.getfixturevalue(request.param)


def engine_config(directory, **settings) -> EngineConfig:
    if str(directory).endswith(".gguf"):  # float32 workers keep its blocks (else bfloat16)
        settings.setdefault("dtype", "float32")
    return EngineConfig(
        model=str(directory),
        port=0,
        block_size=4,
        **{
            "max_model_len": 256,
            "speculative_config": SPEC,
            "kv_cache_memory_bytes": 16 << 20,
            "mamba_state_interval": 8,  # a hybrid's prefix hits at multiples of 8 tokens
            **settings,
        },
    )


def speculation_counts(client: Client) -> tuple[int, int, int]:
    info = client.info()
    return (
        info["spec_decode_num_drafts"],
        info["spec_decode_num_draft_tokens"],
        info["spec_decode_num_accepted_tokens"],
    )


def test_greedy_tokens_equal_transformers_with_drafts_accepted_and_rejected(model):
    family, directory, expected, follow_ups, follow_up_expected = model
    layout = {"llama": "LHBNC", "deepseek": "BLHNC", "nemotron_h": "BLNHC", "llama_gguf": "BHLNC"}[
        family
    ]
    # A budget of 24 tokens chunks every prompt off block boundaries and caps drafts too.
    config = engine_config(directory, kv_cache_layout=layout, max_num_batched_tokens=24)
    with LocalServer(config) as server, Client(server.address) as client:
        assert generate_all(server.address, REPEATING, NUM_TOKENS) == expected
        drafts, draft_tokens, accepted = speculation_counts(client)
        assert drafts > 0 and 0 < accepted < draft_tokens
        # The follow-ups hit blocks whose last slots rejected drafts wrote before the
        # verified tokens did: only verified K/V may have been cached.
        for prompt, want in zip(follow_ups, follow_up_expected, strict=True):
            done = client.generate(prompt, max_tokens=12, temperature=0)
            assert done.usage.cached_prompt_tokens > 0
            assert done.token_ids == want
        if family == "llama_gguf":
            assert c_decoder_steps(server) > 0


def test_preemption_with_drafts_in_play_keeps_the_tokens(model):
    family, directory, expected, _, _ = model
    # 40 blocks of 4 tokens hold one request of the longest (128), not all three at once
    # (100 + 46 + 78 tokens). A hybrid's request may also hold, per Mamba layer, its state,
    # its copy source, a step's 4 checkpoints (32 tokens a step, a state every 8) and 3 draft
    # states: 18 more.
    settings = dict(max_model_len=128, num_gpu_blocks_override=40)
    if family == "nemotron_h":
        settings.update(num_gpu_blocks_override=58, max_num_batched_tokens=32)
    config = engine_config(directory, **settings)
    with LocalServer(config) as server, Client(server.address) as client:
        assert generate_all(server.address, REPEATING, NUM_TOKENS) == expected
        assert server.engine.scheduler.num_preemptions > 0
        assert speculation_counts(client)[2] > 0


@pytest.fixture(params=["llama", "deepseek"])
def attention_model(request):
    """The models whose greedy outputs here repeat enough that drafts are accepted on single
    requests (the hybrid's wander: stops would never fall inside accepted drafts)."""
    return request.getfixturevalue(request.param)


def test_stops_and_lengths_end_where_plain_decoding_ends(attention_model):
    _, directory, expected, _, _ = attention_model
    with LocalServer(engine_config(directory)) as server, Client(server.address) as client:
        for prompt, want in zip(REPEATING, expected, strict=True):
            for max_tokens in (5, 13):
                done = client.generate(prompt, max_tokens=max_tokens, temperature=0)
                assert done.token_ids == want[:max_tokens]
                assert done.finish_reason == "length"
            # A stop token's first occurrence ends the request; several, so that some fall
            # inside a step's accepted drafts and some at its end.
            for stop in list(dict.fromkeys(want[1:]))[:8]:
                done = client.generate(
                    prompt, max_tokens=NUM_TOKENS, temperature=0, stop_token_ids=[stop]
                )
                assert done.token_ids == want[: want.index(stop) + 1]
                assert done.finish_reason == "stop"
                assert done.usage.completion_tokens == len(done.token_ids)
        # Requests asking for log-probabilities decode without drafts and still answer.
        before = speculation_counts(client)
        done = client.generate(REPEATING[0], max_tokens=8, temperature=0, logprobs=2)
        assert done.token_ids == expected[0][:8] and len(done.logprobs) == 8
        assert speculation_counts(client) == before
        # Sampled requests verify drafts by speculative sampling.
        sampled = client.generate(REPEATING[0], max_tokens=30, temperature=0.8, seed=7)
        assert len(sampled.token_ids) == 30
        metrics = server.engine.metrics.render().decode()
        assert "kvray:spec_decode_num_accepted_tokens_total" in metrics
        assert "kvray:spec_decode_num_accepted_tokens_per_pos_total{model_name=" in metrics


@pytest.mark.parametrize("family", ["llama", "nemotron_h"])
def test_tensor_parallel_ranks_agree_on_what_was_accepted(family, request):
    _, directory, expected, _, _ = request.getfixturevalue(family)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        server = RayServer(engine_config(directory, tensor_parallel_size=2, cpus_per_worker=1))
        try:
            with Client(server.address) as client:
                assert generate_all(server.address, REPEATING, NUM_TOKENS) == expected
                assert speculation_counts(client)[2] > 0
        finally:
            server.stop()
    finally:
        ray.shutdown()


class OracleProposer:
    """Drafts that are a request's true greedy continuation with the draft at one depth
    wrong, the depth cycling through every one (and none): each step keeps a known number."""

    def __init__(self, sequences: list[list[int]], num_drafts: int):
        self.sequences = sequences
        self.num_drafts = num_drafts
        self.planned: list[tuple[int, int]] = []  # (drafts, how many of them are right)

    def propose(self, token_ids, max_drafts: int) -> list[int]:
        known = list(token_ids)
        sequence = next((s for s in self.sequences if s[: len(known)] == known), None)
        if sequence is None:  # the request went astray: its tokens will say so
            return []
        drafts = sequence[len(known) : len(known) + min(max_drafts, self.num_drafts)]
        if not drafts:
            return []
        wrong_at = len(self.planned) % (len(drafts) + 1)  # len(drafts): all right
        if wrong_at < len(drafts):
            drafts[wrong_at] = (drafts[wrong_at] + 1) % VOCAB
        self.planned.append((len(drafts), wrong_at))
        return drafts


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_hybrid_states_roll_back_to_every_draft_depth(nemotron_h, prefix_caching):
    """A Mamba state that took k drafts in must become the state after the ones kept, for
    every count kept from none to all: drafts from an oracle, wrong at a known depth. With
    prefix caching the draft states sit beside the positional table (states every 8 tokens,
    so rejected drafts often cross a boundary), without it after the state in its row."""
    _, directory, expected, _, _ = nemotron_h
    sequences = [p + out for p, out in zip(REPEATING, expected, strict=True)]
    config = engine_config(directory, enable_prefix_caching=prefix_caching)
    with LocalServer(config) as server, Client(server.address) as client:
        oracle = OracleProposer(sequences, num_drafts=3)
        server.engine.scheduler.proposer = oracle
        for prompt, want in zip(REPEATING, expected, strict=True):
            assert client.generate(prompt, max_tokens=NUM_TOKENS, temperature=0).token_ids == want
        drafts, draft_tokens, accepted = speculation_counts(client)
        assert drafts == len(oracle.planned)
        assert draft_tokens == sum(n for n, _ in oracle.planned)
        assert accepted == sum(right for _, right in oracle.planned)
        assert {right for n, right in oracle.planned if n == 3} == {0, 1, 2, 3}
