"""The same model and requests through Hugging Face ``generate``, for comparison, run as a
careful user would: on the same device and dtype as kvray, requests sorted by prompt length
into padded static batches (so padding wastes little), greedy. Each batch runs to its longest
request's length, but only the tokens each request asked for are credited."""

from __future__ import annotations

import time

import torch

from cluster.bench.workload import BenchRequest
from workers.default_model import default_checkpoint
from workers.model_source import gguf_path_for, is_embedded, model_config_for


def load_hf_model(model: str | None, device: torch.device, dtype: torch.dtype):
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "--compare transformers needs the transformers package (pip install 'kvray[test]')"
        ) from None
    gguf = gguf_path_for(model)
    if gguf is not None:  # transformers dequantizes the same file
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=dtype
        )
        return loaded.to(device).eval()
    if not is_embedded(model):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        return loaded.to(device).eval()
    config = model_config_for(model)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
    )
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    hf_model.load_state_dict(default_checkpoint(config))
    return hf_model.to(device=device, dtype=dtype)


def hf_generate_throughput(
    model: str | None,
    requests: list[BenchRequest],
    batch_size: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    device = torch.device(device)
    hf_model = load_hf_model(model, device, dtype)
    by_length = sorted(requests, key=lambda r: len(r.prompt))
    synchronize(device)
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(by_length), batch_size):
            batch = by_length[start : start + batch_size]
            longest = max(len(r.prompt) for r in batch)
            ids = torch.zeros(len(batch), longest, dtype=torch.long)
            mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for row, request in enumerate(batch):  # left padding, as generate expects
                ids[row, longest - len(request.prompt) :] = torch.tensor(request.prompt)
                mask[row, longest - len(request.prompt) :] = 1
            new_tokens = max(r.max_tokens for r in batch)
            hf_model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    synchronize(device)
    wall = time.perf_counter() - started
    output_tokens = sum(r.max_tokens for r in requests)
    total_tokens = output_tokens + sum(len(r.prompt) for r in requests)
    return {
        "engine": f"transformers ({device.type}, sorted batches of {batch_size})",
        "requests": len(requests),
        "duration_s": wall,
        "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": total_tokens / wall,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
