"""DeepSeek-V3/V2 (multi-head latent attention): kvray's greedy tokens equal transformers'
``generate`` token for token, with only the latent ``[kv_c | k_pe]`` of each token in kvcore's
cache. The nope (20), rope (6) and value (14) head sizes all differ; the latent is 32.

Each case runs the three prompts together (continuous batching: one request decodes while
others still prefill) in chunks, and compares with transformers run one prompt at a time.
Decode tokens attend in latent space; so do prefill chunks of fewer than 9 new tokens (this
geometry's expansion threshold) and those whose context is past the step's expansion budget;
longer chunks expand their context to per-head K/V (``workers.kinds.mla_metadata``). Chunks of 9 or
64 take both prefill paths (a prompt's tail chunk is short), chunks of 5-7 only the latent.
"""

from __future__ import annotations

import msgspec
import pytest

from kernels.mla.torch_backend import TorchMLABackend
from kvcore import KVCacheLayout, decode, encode
from tests.workers.engine import (
    prompt_batches,
    run_in_process,
    run_tensor_parallel,
    start_worker,
    tiny_model_options,
)
from tests.workers.harness import StepDriver
from tests.workers.hf_models import NUM_OUTPUT_TOKENS, PROMPTS, reference_generations, save_deepseek
from workers.layers.mla_attention import MLAAttention
from workers.protocol import StepResult

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,  # the softmax-scale correction is in play
    "original_max_position_embeddings": 128,
    "rope_theta": 10000.0,
}
MODELS = {
    # name -> save_deepseek keyword arguments
    "v3/q-none": dict(q_lora_rank=None),
    "v3/q24": dict(q_lora_rank=24),
    "v3/q24-yarn-halves": dict(q_lora_rank=24, rope_parameters=YARN, rope_interleave=False),
    "v2/q-none": dict(q_lora_rank=None, version=2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model dir, reference outputs by request id)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            directory = save_deepseek(tmp_path_factory.mktemp("deepseek"), **MODELS[name])
            reference = reference_generations(directory, PROMPTS)
            cache[name] = directory, {f"r{i}": out for i, out in enumerate(reference)}
        return cache[name]

    return get


options = tiny_model_options


def batches(num_tokens: int = NUM_OUTPUT_TOKENS):
    return prompt_batches(PROMPTS, num_tokens)


CASES = [
    # model, layout, tensor parallel size, prefill chunk
    ("v3/q-none", "LBHNC", 1, 7),
    ("v3/q24", "BLNHC", 1, 5),
    ("v3/q24-yarn-halves", "BLHNC", 1, 64),
    ("v2/q-none", "LBNHC", 1, 6),
    ("v3/q24", "LHBNC", 1, 9),
]


@pytest.mark.parametrize(("name", "layout", "tp", "chunk"), CASES)
def test_greedy_tokens_match_transformers(models, name, layout, tp, chunk):
    model_dir, expected = models(name)
    run = run_in_process if tp == 1 else run_tensor_parallel
    assert run(options(model_dir, tp=tp), layout, batches(), chunk=chunk) == expected
    # The model must not be trivially repetitive, or this comparison would prove little.
    assert all(len(set(tokens)) > 8 for tokens in expected.values())


def test_every_layout_serves(models):
    """One latent head per layer and one page size: every layout expresses it."""
    model_dir, expected = models("v3/q24")
    for layout in KVCacheLayout:
        outputs = run_in_process(options(model_dir), layout.name, batches(12), chunk=9)
        assert outputs == {rid: tokens[:12] for rid, tokens in expected.items()}, layout.name


def test_prefills_past_the_expansion_budget_attend_in_latent_space(models, monkeypatch):
    """With a budget of 12 context tokens a step, the first 9-token chunk of a prompt expands
    and its later chunks (contexts past 12) attend in latent space, one row per token, at most
    max_num_seqs (2) rows per kernel call; the tokens are the same."""
    model_dir, expected = models("v3/q-none")
    expanded_contexts, latent_rows, rows_per_call = [], [], []
    decode = TorchMLABackend.decode

    def count_call(self, q_latent, *args, **kwargs):
        rows_per_call.append(q_latent.shape[0])
        return decode(self, q_latent, *args, **kwargs)

    attend_latent, attend_expanded = MLAAttention._attend_latent, MLAAttention._attend_expanded

    def count_latent(self, context, metadata, rows, *args):
        latent_rows.append(rows.seq_lens.numel())
        return attend_latent(self, context, metadata, rows, *args)

    def count_expanded(self, context, prefills, *args):
        expanded_contexts.append(prefills.context_slots.numel())
        return attend_expanded(self, context, prefills, *args)

    monkeypatch.setattr(MLAAttention, "_attend_latent", count_latent)
    monkeypatch.setattr(MLAAttention, "_attend_expanded", count_expanded)
    monkeypatch.setattr(TorchMLABackend, "decode", count_call)
    small = options(model_dir, max_num_batched_tokens=12, max_num_seqs=2)
    assert run_in_process(small, "LBHNC", batches(8), chunk=9) == {
        rid: tokens[:8] for rid, tokens in expected.items()
    }
    assert max(expanded_contexts) <= 12
    assert max(latent_rows) >= 9  # a prefill chunk's tokens, not only decode rows
    assert max(rows_per_call) == 2


def test_preempted_requests_recompute_their_latents(models):
    model_dir, expected = models("v3/q24")
    worker = start_worker(options(model_dir), "BLNHC")
    config = worker.runner.config
    driver = StepDriver(config, lambda p: decode(worker.execute(encode(p)), StepResult))
    requests = [(f"r{i}", p, NUM_OUTPUT_TOKENS) for i, p in enumerate(PROMPTS)]
    outputs = driver.generate(requests, chunk=7, preempt_after={"r0": 20, "r1": 12, "r2": 25})
    assert outputs == expected


@pytest.mark.parametrize(
    ("backend", "tp", "layout", "num_tokens"),
    [
        ("torch", 1, "BLHNC", NUM_OUTPUT_TOKENS),
        ("torch", 2, "BHLNC", 10),
        ("triton", 1, "LBHNC", 5),
    ],
)
def test_a_prefix_hit_reads_the_cached_latents(models, backend, tp, layout, num_tokens):
    """The second prompt shares 17 tokens with the first: its first 16 (four blocks) come from
    the cache, and its prefill (11 new tokens) expands those cached latents with its own. The
    TP 2 case is this file's run with query heads split over two ranks (q_proj's here;
    ``kvray serve -tp 2`` in test_mla_cli splits q_b_proj's)."""
    model_dir, expected = models("v3/q-none")
    second = [*PROMPTS[0][:17], 90, 91, 92, 93, 94, 95, 96, 97, 98, 99]
    (second_expected,) = reference_generations(model_dir, [second], num_tokens)
    run = run_in_process if tp == 1 else run_tensor_parallel
    outputs = run(
        options(model_dir, backend=backend, tp=tp),
        layout,
        [[("r0", PROMPTS[0], num_tokens, None)], [("again", second, num_tokens, "r0")]],
        chunk=12,
    )
    assert outputs == {"r0": expected["r0"][:num_tokens], "again": second_expected}


def test_triton_backend_matches_transformers(models):
    """The Triton latent write, split-KV latent decode and paged prefill (the interpreter on
    CPUs: a short run): first chunks of 9 expand, later ones (past the budget of 12) and
    decodes attend in latent space. Greedy outputs are prefixes of longer ones."""
    model_dir, expected = models("v3/q-none")
    small = msgspec.structs.replace(options(model_dir, backend="triton"), max_num_batched_tokens=12)
    outputs = run_in_process(small, "BLHNC", batches(5), chunk=9)
    assert outputs == {rid: tokens[:5] for rid, tokens in expected.items()}
