"""``kvray bench speculative``: the same repeat-this-text requests with speculative decoding
off and on, one request at a time. Greedy tokens must be identical (the run says so, and
fails when they are not); the figures are decode tokens per second of each run (after the
first token, so prefill does not count), their ratio, and the drafts' acceptance."""

from __future__ import annotations

import random
import time

import msgspec

from cluster.client import Client, InvalidRequestError
from cluster.config import EngineConfig
from cluster.launch import running_engine

DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
PASSAGE = (
    "Ray is a unified framework for scaling AI and Python applications. It consists of a "
    "core distributed runtime and a set of libraries for simplifying machine learning "
    "compute. Serving a language model means keeping its weights and its attention cache in "
    "memory, batching the requests that arrive, and returning each token as soon as it is "
    "made, so that a user reading the answer never waits for the whole of it."
)


def prompts(num_prompts: int, seed: int) -> list:
    """Conversations asking for the passage back (a chat model copies it: drafts come true),
    the passage's sentences shuffled per prompt so each is its own request."""
    sentences = [s.strip() + "." for s in PASSAGE.split(".") if s.strip()]
    rng = random.Random(seed)
    result = []
    for _ in range(num_prompts):
        rng.shuffle(sentences)
        text = " ".join(sentences)
        content = f"Repeat the following text exactly, word for word:\n\n{text}"
        result.append([{"role": "user", "content": content}])
    return result


def token_prompts(num_prompts: int, vocab_size: int, seed: int) -> list[list[int]]:
    """For models without a chat template: random tokens, said twice."""
    rng = random.Random(seed)
    half = [[rng.randrange(vocab_size) for _ in range(48)] for _ in range(num_prompts)]
    return [tokens + tokens for tokens in half]


def run(address: str, requests: list, max_tokens: int) -> tuple[list[list[int]], float, dict]:
    """Each request alone: its tokens, the decode tokens per second over all, the info."""
    outputs, decode_tokens, decode_seconds = [], 0, 0.0
    with Client(address) as client:
        for prompt in requests:
            tokens, first_at = [], None
            started = time.perf_counter()
            for delta in client.stream(prompt, max_tokens=max_tokens, temperature=0):
                if delta.token_ids and first_at is None:
                    first_at, first_count = time.perf_counter(), len(delta.token_ids)
                tokens.extend(delta.token_ids)
            ended = time.perf_counter()
            if first_at is not None and len(tokens) > first_count:
                decode_tokens += len(tokens) - first_count
                decode_seconds += ended - max(first_at, started)
            outputs.append(tokens)
        info = client.info()
    return outputs, decode_tokens / max(decode_seconds, 1e-9), info


def speculative(config: EngineConfig, args) -> list[dict]:
    spec = config.speculative_config or DEFAULT_SPEC
    in_process = getattr(args, "in_process", False)
    rows, outputs = [], {}
    requests = None
    for label, setting in (("off", None), ("on", spec)):
        run_config = msgspec.structs.replace(config, port=0, speculative_config=setting)
        with running_engine(run_config, in_process=in_process) as address:
            if requests is None:
                requests = _requests(address, args)
            outputs[label], tok_s, info = run(address, requests, args.output_len)
        drafted = info["spec_decode_num_draft_tokens"]
        rows.append(
            {
                "speculation": label if setting is None else f"on: {setting}",
                "requests": len(requests),
                "output_tokens": sum(len(t) for t in outputs[label]),
                "decode_tokens_per_s": tok_s,
                "acceptance": info["spec_decode_num_accepted_tokens"] / drafted if drafted else 0,
                "step_overhead_median_ms": info["step_overhead_median_ms"],
            }
        )
    rows[1]["speedup"] = rows[1]["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
    rows[1]["same_tokens"] = outputs["on"] == outputs["off"]
    if not rows[1]["same_tokens"]:
        raise RuntimeError(f"speculative decoding changed greedy tokens: {rows}")
    return rows


def _requests(address: str, args) -> list:
    """Chat prompts when the model has a template, else token prompts."""
    chats = prompts(args.num_prompts, args.seed)
    with Client(address) as client:
        try:
            client.generate(chats[0], max_tokens=1, temperature=0)
            return chats
        except InvalidRequestError:
            return token_prompts(args.num_prompts, client.info()["vocab_size"], args.seed)
