"""The C decoder-layer path (``workers.models.llama_cpu_decode``) takes the short steps (decode,
and prefill chunks of up to 32 tokens) of a Llama whose projections are kept in GGUF blocks,
or whose weights are float32 (the C glue between torch's projections), and each of its steps
gives the hidden states the torch modules give for the same step; a step or a model it
cannot serve goes through the modules. Speculative verification through it
is in tests/cluster/test_speculative_decoding.py."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors.torch import load_file

from kernels.quant.gguf_blocks import QuantizedMatrix
from tests.workers.engine import (
    KV_CACHE_MEMORY,
    run_requests,
    run_tensor_parallel,
    start_worker,
    tiny_model_options,
)
from tests.workers.hf_models import PROMPTS, reference_generations, save_model
from workers.models.llama_cpu_decode import CpuDecodePath
from workers.worker import WorkerOptions

# How far the path's hidden states may be from the modules': within float32 rounding, and
# with a half-precision cache one unit of its last place (2^-11 relative in float16, 2^-8 in
# bfloat16), which a key rounds to when the path's rotation and the modules' differ in
# float32's last bit.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def compared_steps(monkeypatch):
    """Every step the path takes is run again through the modules and the two hidden states
    compared; the modules' result is what the step returns. Yields the list of row counts
    compared."""
    taken = CpuDecodePath.forward
    rows = []

    def checked(self, token_ids, positions):
        fused = taken(self, token_ids, positions)
        if fused is None:
            return None
        model = self.model
        model._cpu_decode = None
        try:
            modules = model(token_ids, positions)
        finally:
            model._cpu_decode = self
        tolerance = TOLERANCE[model.layers[0].self_attn.attn.kv_cache.dtype]
        torch.testing.assert_close(fused, modules, rtol=tolerance, atol=tolerance)
        rows.append(token_ids.shape[0])
        return modules

    monkeypatch.setattr(CpuDecodePath, "forward", checked)
    return rows


def gguf_options(path, **extra) -> WorkerOptions:
    return WorkerOptions(
        model=str(path), block_size=4, kv_cache_memory_bytes=KV_CACHE_MEMORY, dtype="float32",
        **extra,
    )  # fmt: skip


@pytest.mark.parametrize("layout", ["LBNHC", "BHLNC"])
def test_decode_steps_go_through_the_c_layers_and_equal_transformers(
    quantized_files, compared_steps, layout
):
    hf_dir, path = quantized_files["all"]
    worker = start_worker(gguf_options(path), layout)
    requests = [(f"r{i}", prompt, 12, None) for i, prompt in enumerate(PROMPTS)]
    outputs = run_requests(worker, [requests], chunk=7)
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == reference_generations(
        hf_dir, PROMPTS, 12
    )
    path_taken = worker.model.model._cpu_decode
    assert isinstance(path_taken, CpuDecodePath)
    # Prefill chunks of up to 7 tokens per request (more rows than requests), then decode
    # steps of 3, 2 and 1 rows: the float kernel and the int16 one, as the CPU has them.
    assert {1, 2, 3} <= set(compared_steps), compared_steps
    assert max(compared_steps) > len(PROMPTS), compared_steps
    assert path_taken.num_steps == len(compared_steps)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_caches_go_through_the_c_layers(
    quantized_files, compared_steps, cache_dtype
):
    # Each step's keys and values are rounded into the cache and read back by the step's own
    # attention, so a wrong cell shows in that step's hidden states.
    _, path = quantized_files["all"]
    name = str(cache_dtype).removeprefix("torch.")
    worker = start_worker(gguf_options(path, kv_cache_dtype=name), "BLNHC")
    requests = [(f"r{i}", prompt, 10, None) for i, prompt in enumerate(PROMPTS)]
    run_requests(worker, [requests], chunk=6)
    assert worker.model.model.layers[0].self_attn.attn.kv_cache.dtype == cache_dtype
    path_taken = worker.model.model._cpu_decode
    assert isinstance(path_taken, CpuDecodePath)
    assert {1, 2, 3} <= set(compared_steps), compared_steps
    assert path_taken.num_steps == len(compared_steps)


def test_after_a_prefix_hit_and_a_second_batch_the_tokens_stay_exact(quantized_files):
    hf_dir, path = quantized_files["all"]
    worker = start_worker(gguf_options(path), "LBNHC")
    first = [("a", PROMPTS[2], 8, None)]
    second = [("b", [*PROMPTS[2][:20], 7, 8, 9], 8, "a"), ("c", PROMPTS[0], 8, None)]
    outputs = run_requests(worker, [first, second], chunk=64)
    expected = reference_generations(hf_dir, [PROMPTS[2], second[0][1], PROMPTS[0]], 8)
    assert [outputs["a"], outputs["b"], outputs["c"]] == expected
    assert worker.model.model._cpu_decode.num_steps > 0


def rank_steps(worker) -> int:
    return worker.model.model._cpu_decode.num_steps


def test_two_ranks_reduce_between_the_c_blocks(quantized_files):
    hf_dir, path = quantized_files["all"]
    batch = [[(f"r{i}", prompt, 10, None) for i, prompt in enumerate(PROMPTS[:2])]]
    outputs, steps = run_tensor_parallel(
        gguf_options(path, tensor_parallel_size=2), "BLHNC", batch, chunk=5, probe=rank_steps
    )
    assert [outputs["r0"], outputs["r1"]] == reference_generations(hf_dir, PROMPTS[:2], 10)
    assert min(steps) > 0 and len(set(steps)) == 1, steps


@pytest.mark.parametrize("layout", ["LBNHC", "BHLNC"])
def test_float_weights_go_through_the_c_glue_and_equal_transformers(
    tmp_path, compared_steps, layout
):
    hf_dir = save_model("llama", tmp_path / "llama")
    worker = start_worker(tiny_model_options(hf_dir, dtype="float32"), layout)
    requests = [(f"r{i}", prompt, 12, None) for i, prompt in enumerate(PROMPTS)]
    outputs = run_requests(worker, [requests], chunk=7)
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == reference_generations(
        hf_dir, PROMPTS, 12
    )
    path_taken = worker.model.model._cpu_decode
    assert isinstance(path_taken, CpuDecodePath) and not path_taken.fused
    assert {1, 2, 3} <= set(compared_steps), compared_steps
    assert max(compared_steps) > len(PROMPTS), compared_steps  # prefill chunks too
    assert path_taken.num_steps == len(compared_steps)


def test_a_decode_batch_past_the_fused_bound_goes_through_the_c_glue(tmp_path, compared_steps):
    # 40 requests decode together: more rows than the GGUF blocks take, and the scratch
    # grows past its first size.
    hf_dir = save_model("llama", tmp_path / "llama")
    worker = start_worker(tiny_model_options(hf_dir, dtype="float32"), "LBHNC")
    prompts = [PROMPTS[i % len(PROMPTS)][: 5 + i % 7] for i in range(40)]
    requests = [(f"r{i}", prompt, 4, None) for i, prompt in enumerate(prompts)]
    outputs = run_requests(worker, [requests], chunk=64)
    expected = reference_generations(hf_dir, prompts[:3], 4)
    assert [outputs["r0"], outputs["r1"], outputs["r2"]] == expected
    assert 40 in compared_steps, compared_steps


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float_weights_with_a_half_precision_cache_go_through_the_c_glue(
    tmp_path, compared_steps, cache_dtype
):
    hf_dir = save_model("llama", tmp_path / "llama")
    name = str(cache_dtype).removeprefix("torch.")
    options = tiny_model_options(hf_dir, dtype="float32", kv_cache_dtype=name)
    worker = start_worker(options, "BLNHC")
    requests = [(f"r{i}", prompt, 10, None) for i, prompt in enumerate(PROMPTS)]
    run_requests(worker, [requests], chunk=6)
    assert not worker.model.model._cpu_decode.fused
    assert {1, 2, 3} <= set(compared_steps), compared_steps


def test_two_ranks_reduce_between_the_c_glue_calls(tmp_path):
    hf_dir = save_model("llama", tmp_path / "llama")
    batch = [[(f"r{i}", prompt, 10, None) for i, prompt in enumerate(PROMPTS[:2])]]
    options = tiny_model_options(hf_dir, dtype="float32", tp=2)
    outputs, steps = run_tensor_parallel(options, "BLHNC", batch, chunk=5, probe=rank_steps)
    assert [outputs["r0"], outputs["r1"]] == reference_generations(hf_dir, PROMPTS[:2], 10)
    assert min(steps) > 0 and len(set(steps)) == 1, steps


def test_mixed_gguf_types_go_through_the_c_glue(quantized_files, compared_steps):
    # Fused QKV and gate-up of mixed types are dequantized (workers.quantization): float
    # projections beside GGUF blocks, each multiplied as the modules multiply it.
    worker = start_worker(gguf_options(quantized_files["mixed"][1]), "LBNHC")
    run_requests(worker, [[("r", PROMPTS[1], 4, None)]], chunk=64)
    path_taken = worker.model.model._cpu_decode
    assert isinstance(path_taken, CpuDecodePath) and not path_taken.fused
    assert path_taken.num_steps == len(compared_steps) > 0


def test_models_the_c_layers_cannot_compute_go_through_the_modules(tmp_path):
    # Qwen3's Q/K norms are not in the C glue.
    hf_dir = save_model("qwen3-sliding", tmp_path / "qwen3")
    worker = start_worker(tiny_model_options(hf_dir, dtype="float32"), "LBNHC")
    run_requests(worker, [[("r", PROMPTS[1], 4, None)]], chunk=64)
    assert worker.model.model._cpu_decode is None  # looked at, at the first step


def quantize_in_place(worker, hf_dir) -> None:
    """Hold a checkpoint's four projections per layer in Q4_1 blocks, as a GGUF load would."""
    weights = load_file(hf_dir / "model.safetensors")
    for i, layer in enumerate(worker.model.model.layers):
        stem = f"model.layers.{i}"
        parts = {
            layer.self_attn.qkv_proj: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            layer.self_attn.o_proj: ("self_attn.o_proj",),
            layer.mlp.gate_up_proj: ("mlp.gate_proj", "mlp.up_proj"),
            layer.mlp.down_proj: ("mlp.down_proj",),
        }
        for module, names in parts.items():
            rows = torch.cat([weights[f"{stem}.{name}.weight"] for name in names])
            module.packed_weight = QuantizedMatrix.from_gguf(
                "Q4_1", quantize(rows.float().numpy(), Q.Q4_1)
            )
    worker.model.model._cpu_decode = False  # looked at again at the next step


@pytest.mark.parametrize("family", ["qwen2", "mistral"], ids=["qkv-bias", "sliding-window"])
def test_biased_qkv_and_a_sliding_window_give_the_modules_hidden_states(
    tmp_path, compared_steps, family
):
    hf_dir = save_model(family, tmp_path / family)
    worker = start_worker(tiny_model_options(hf_dir, dtype="float32"), "LBNHC")
    quantize_in_place(worker, hf_dir)
    prompts = [PROMPTS[2], PROMPTS[0]]  # past the 8-token window
    requests = [("long", prompts[0], 12, None), ("short", prompts[1], 6, None)]
    run_requests(worker, [requests], chunk=64)
    assert isinstance(worker.model.model._cpu_decode, CpuDecodePath)
    assert {1, 2} <= set(compared_steps), compared_steps
