"""``python -m cluster.bench.structured``: what structured outputs cost the requests beside
them, and what masking costs per step.

1. Throughput: a batch of free-text requests decodes beside ``--neighbours`` other requests,
   first free as well, then constrained (a JSON schema whose one string must be longer than
   any run decodes, so they stay constrained, and running, to the last token). The batch
   size and lengths are the same both times, so the difference is what constrained
   neighbours cost: their masks' filling, the mask applied, the matchers advanced. Figures:
   the free requests' tokens per second, best of ``--repeats``.
2. Per step: filling ``C`` bitmasks with xgrammar and applying them to ``[B, vocab]`` logits,
   timed alone for several ``C`` at this model's vocabulary; and the sampler's whole step
   (``Sampler.sample_rows``, the model's default sampling) for ``--batch + --neighbours`` rows,
   none or ``--neighbours`` of them constrained, median of 60 steps.

The engine is the one ``kvray serve`` runs (one in-process worker, TP 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import torch

from cluster.config import EngineConfig
from cluster.local import LocalServer
from cluster.structured.compiler import GrammarCompiler
from workers.grammar.bitmask import apply_token_bitmask
from workers.grammar.matchers import GrammarMatchers
from workers.grammar.vocabulary import grammar_vocabulary
from workers.model_source import load_tokenizer_for, model_config_for
from workers.sampler import Sampler, SamplingRow
from workers.sampling import SamplingParams
from workers.structured_outputs import StructuredOutputs

LONG_JSON = json.dumps({
    "type": "object",
    "properties": {"notes": {"type": "string", "minLength": 100_000}},
    "required": ["notes"],
})  # fmt: skip


async def _free_throughput(engine, args, constrained: bool) -> float:
    """Tokens per second of the free requests, beside the neighbours."""
    free = engine.sampling_params(
        {"max_tokens": args.tokens, "ignore_eos": True, "temperature": 1.0}
    )
    neighbour_fields = {"max_tokens": args.tokens, "ignore_eos": True, "temperature": 1.0}
    if constrained:
        neighbour_fields["structured_outputs"] = StructuredOutputs(json=LONG_JSON)
    neighbour = engine.sampling_params(neighbour_fields)
    prompt = "Write down everything you know about the history of computing."
    requests = [await engine.prepare(prompt, free) for _ in range(args.batch)]
    others = [await engine.prepare(prompt, neighbour) for _ in range(args.neighbours)]

    async def run(request) -> tuple[int, float]:
        count = 0
        async for output in engine.generate(request):
            count += len(output.token_ids)
        return count, time.perf_counter()

    started = time.perf_counter()
    results = await asyncio.gather(*(run(r) for r in requests + others))
    free_results = results[: args.batch]
    ended = max(end for _, end in free_results)
    return sum(count for count, _ in free_results) / (ended - started)


def throughput(args) -> dict:
    config = EngineConfig(
        model=args.model,
        kv_cache_memory_bytes=args.kv_cache_memory,
        port=0,
        max_model_len=1024,
    )
    figures = {"free": [], "constrained": []}
    with LocalServer(config) as server:
        server.run(_free_throughput(server.engine, args, True))  # warm-up: vocabulary, compile
        for _ in range(args.repeats):
            for kind in figures:
                rate = server.run(_free_throughput(server.engine, args, kind == "constrained"))
                figures[kind].append(rate)
    free, constrained = max(figures["free"]), max(figures["constrained"])
    return {"free_neighbours_tok_s": free, "constrained_neighbours_tok_s": constrained,
            "ratio": constrained / free}  # fmt: skip


@dataclass(frozen=True)
class GrammarSetup:
    """The model's tokenizer as xgrammar sees it, and LONG_JSON compiled against it."""

    model_config: object
    tokenizer: object
    vocabulary: object  # xgrammar.TokenizerInfo
    spec: StructuredOutputs
    grammar: bytes

    @classmethod
    def of(cls, model: str) -> GrammarSetup:
        model_config = model_config_for(model)
        tokenizer = load_tokenizer_for(model, model_config.eos_token_ids)
        vocabulary = grammar_vocabulary(tokenizer, model_config.vocab_size, tokenizer.eos_token_ids)
        spec = StructuredOutputs(json=LONG_JSON)
        grammar = GrammarCompiler(tokenizer, model_config.vocab_size).compile_now(spec)
        return cls(model_config, tokenizer, vocabulary, spec, grammar)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def matchers(self) -> GrammarMatchers:
        return GrammarMatchers(lambda: self.vocabulary)


def mask_cost(setup: GrammarSetup, args) -> list[dict]:
    prefix = setup.tokenizer.encode('{"notes": "The first', add_special_tokens=False)
    rows = []
    for count in (1, 4, 16):
        matchers = setup.matchers()
        for index in range(count):
            matchers.add(f"r{index}", setup.grammar)
        batch = [(f"r{index}", prefix) for index in range(count)]
        logits = torch.randn(max(count, args.batch + args.neighbours), setup.vocab_size)
        fills, applies = [], []
        for _ in range(50):
            started = time.perf_counter()
            indices, bitmask = matchers.masks(batch)
            filled = time.perf_counter()
            apply_token_bitmask(logits, torch.tensor(indices), bitmask)
            fills.append(filled - started)
            applies.append(time.perf_counter() - filled)
        rows.append({"constrained_rows": count, "vocab": setup.vocab_size,
                     "fill_us": statistics.median(fills) * 1e6,
                     "apply_us": statistics.median(applies) * 1e6})  # fmt: skip
    return rows


def sampler_step(setup: GrammarSetup, args) -> dict:
    defaults = {"temperature": 1.0, **(setup.model_config.default_sampling or {})}
    free = SamplingParams(**defaults)
    constrained = SamplingParams(**defaults, structured_outputs=setup.spec)
    num_rows = args.batch + args.neighbours

    def median_step_ms(num_constrained: int) -> float:
        sampler = Sampler("cpu", setup.tokenizer.eos_token_ids, setup.matchers())
        params = [constrained if i < num_constrained else free for i in range(num_rows)]
        outputs = [[] for _ in params]
        for index, p in enumerate(params):
            sampler.add_request(str(index), p, setup.grammar if p is constrained else None)
        times = []
        for _ in range(60):
            rows = [SamplingRow(str(i), p, [1], outputs[i]) for i, p in enumerate(params)]
            logits = torch.randn(num_rows, setup.vocab_size)
            started = time.perf_counter()
            tokens = sampler.sample_rows(logits, rows).tokens.tolist()
            times.append(time.perf_counter() - started)
            for out, token in zip(outputs, tokens, strict=True):
                out.append(token)
        return statistics.median(times) * 1e3

    free_ms = min(median_step_ms(0) for _ in range(2))
    constrained_ms = min(median_step_ms(args.neighbours) for _ in range(2))
    return {"rows": num_rows, "constrained": args.neighbours,
            "sample_ms_free": free_ms, "sample_ms_with_constrained": constrained_ms}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:smollm2")
    parser.add_argument("--batch", type=int, default=6, help="free requests")
    parser.add_argument("--neighbours", type=int, default=2, help="requests beside them")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request decodes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=128 << 20)
    args = parser.parse_args(argv)
    setup = GrammarSetup.of(args.model)
    for row in mask_cost(setup, args):
        print(json.dumps(row))
    print(json.dumps(sampler_step(setup, args)))
    print(json.dumps(throughput(args)))


if __name__ == "__main__":
    main()
