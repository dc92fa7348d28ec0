"""``--kv-cache-dtype``: a float32 model whose attention caches are stored in float16 or
bfloat16. Every layer's view has the asked dtype, recurrent (Mamba) states keep the model's,
the cache holds twice the tokens in the same bytes, and every greedy token is transformers'
argmax over the same prefix with its K/V rounded to the cache dtype (tiny random models).

The reference rounds K and V where kvray does, on their way into the cache (after RoPE), and
recomputes each prefix in one forward: transformers' own incremental ``generate`` takes a
different summation order from its prefill, which flips near-ties under bfloat16's coarse
rounding, so it is not one fixed reference to compare against."""

from __future__ import annotations

import pytest
import torch

from kvcore import get_kv_cache_config
from kvcore.views import TORCH_DTYPES
from tests.workers.engine import prompt_batches, run_requests, start_worker, tiny_model_options
from tests.workers.hf_models import NUM_OUTPUT_TOKENS, PROMPTS, save_model, save_nemotron_h
from workers.kv_specs import rank_kv_cache_specs
from workers.model_source import model_config_for
from workers.options import WorkerOptions


def argmax_misses(model_dir, outputs: dict, kv_dtype: torch.dtype) -> dict[int, list[int]]:
    """Per prompt, the steps where kvray's token is not transformers' argmax given the same
    prefix, with every K/V rounded to ``kv_dtype`` as it enters the cache."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def next_token(ids: list[int]) -> int:
        cache = DynamicCache(config=model.config)
        store = cache.update

        def rounded(key, value, layer_idx, *args, **kwargs):
            return store(key.to(kv_dtype).float(), value.to(kv_dtype).float(), layer_idx,
                         *args, **kwargs)  # fmt: skip

        cache.update = rounded
        logits = model(torch.tensor([ids]), past_key_values=cache).logits
        return int(logits[0, -1].argmax())

    misses = {}
    with torch.inference_mode():
        for i, prompt in enumerate(PROMPTS):
            tokens = outputs[f"r{i}"]
            assert len(tokens) == NUM_OUTPUT_TOKENS
            misses[i] = [
                t for t in range(len(tokens)) if next_token(prompt + tokens[:t]) != tokens[t]
            ]
    return misses


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(
    ("kv_cache_dtype", "layout", "chunk"), [("float16", "LHBNC", 7), ("bfloat16", "BLNHC", 5)]
)
def test_a_half_precision_cache_serves_the_rounded_models_tokens(
    llama, kv_cache_dtype, layout, chunk
):
    worker = start_worker(tiny_model_options(llama, kv_cache_dtype=kv_cache_dtype), layout)
    dtype = TORCH_DTYPES[kv_cache_dtype]
    assert worker.model.model.embed_tokens.weight.dtype == torch.float32
    assert {layer.kv_cache.dtype for layer in worker.model.kv_cache_layers().values()} == {dtype}
    outputs = run_requests(worker, prompt_batches(PROMPTS, NUM_OUTPUT_TOKENS), chunk=chunk)
    assert argmax_misses(llama, outputs, dtype) == {i: [] for i in range(len(PROMPTS))}
    # ... and the rounding is real: float32 K/V would have chosen otherwise somewhere.
    assert argmax_misses(llama, outputs, torch.float32) != {i: [] for i in range(len(PROMPTS))}


def test_a_hybrids_attention_cache_is_half_precision_and_its_states_are_not(tmp_path):
    directory = save_nemotron_h(tmp_path, "M*-M", n_groups=2)
    worker = start_worker(tiny_model_options(directory, kv_cache_dtype="float16"), "BLHNC")
    layers = worker.model.kv_cache_layers()
    options, config = worker.options, worker.model_config
    specs = rank_kv_cache_specs(
        config, options.block_size, 1, 0,
        kv_cache_dtype=options.cache_dtype(config.dtype),
        model_dtype=options.model_dtype(config.dtype),
    )  # fmt: skip
    kinds = {name: type(spec).__name__ for name, spec in specs.items()}
    assert sorted(kinds.values()) == ["FullAttentionSpec", "MambaSpec", "MambaSpec"]
    for name, spec in specs.items():
        if kinds[name] == "MambaSpec":
            assert spec.dtypes == ("float32", "float32")  # conv state, SSM state
        else:
            assert spec.dtype == "float16"
            assert layers[name].kv_cache.dtype == torch.float16
    outputs = run_requests(worker, prompt_batches(PROMPTS, NUM_OUTPUT_TOKENS), chunk=9)
    assert argmax_misses(directory, outputs, torch.float16) == {i: [] for i in range(len(PROMPTS))}


def test_a_float16_cache_holds_twice_the_blocks_in_the_same_bytes():
    config = model_config_for("embedded:tiny")
    blocks = {}
    for kv_cache_dtype in ("auto", "float16", "bfloat16"):
        options = WorkerOptions(kv_cache_dtype=kv_cache_dtype)
        specs = rank_kv_cache_specs(
            config, 16, 1, 0, kv_cache_dtype=options.cache_dtype(config.dtype)
        )
        plan = get_kv_cache_config(
            specs, 64 << 20, "LHBNC", max_model_len=256, max_num_batched_tokens=256
        )
        blocks[kv_cache_dtype] = plan.num_blocks
    assert config.dtype == "float32"
    assert blocks["float16"] == blocks["bfloat16"] == 2 * blocks["auto"]


def test_unserved_cache_dtypes_are_refused_by_name():
    for name in ("fp8", "fp8_e4m3", "int8", "float64"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{name}' is not served"):
            WorkerOptions(kv_cache_dtype=name)
    assert WorkerOptions(dtype="bfloat16").cache_dtype("float32") == "bfloat16"  # auto
    assert WorkerOptions(dtype="bfloat16", kv_cache_dtype="float32").cache_dtype("x") == "float32"
