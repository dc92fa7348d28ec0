"""Running a request's choices (every prompt x ``n``) on the engine, as one stream.

All choices are validated and built before any runs, so a bad one refuses the whole request
with nothing started. Their outputs arrive interleaved, tagged with the choice's index; a
consumer that stops early (a client that went away) cancels every choice, which aborts its
engine request and frees its blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from cluster.engine import AsyncEngine, RequestOutput
from cluster.scheduler.request import EngineRequest
from workers.protocol import TokenLogprobs
from workers.request_limits import INT64_MIN

_DONE = object()


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, output: RequestOutput) -> None:
        self.text += output.text
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs or []
        self.prompt_tokens = output.prompt_tokens
        self.cached_tokens = output.cached_prompt_tokens
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason


async def prepare_choices(
    engine: AsyncEngine,
    prompts: Sequence[str | list[int]],
    sampling_fields: dict,
    n: int,
    cache_salt: str | None,
) -> list[EngineRequest]:
    """One engine request per prompt x n, in choice order, each prompt tokenized once. With a
    seed, choice i of a prompt draws with seed + i (wrapping within 64 bits), so the choices
    differ and the response is reproducible."""
    samplings = [engine.sampling_params(choice_fields(sampling_fields, i)) for i in range(n)]
    requests = []
    for prompt in prompts:
        first = await engine.prepare(prompt, samplings[0], cache_salt=cache_salt)
        token_ids = first.prompt_token_ids
        requests.append(first)
        for sampling in samplings[1:]:
            requests.append(await engine.prepare(token_ids, sampling, cache_salt=cache_salt))
        await asyncio.sleep(0)  # many prompts: let health checks and streams in between
    return requests


def choice_fields(sampling_fields: dict, index: int) -> dict:
    seed = sampling_fields.get("seed")
    if index == 0 or seed is None:
        return sampling_fields
    wrapped = (seed + index - INT64_MIN) % (1 << 64) + INT64_MIN
    return {**sampling_fields, "seed": wrapped}


async def stream_choices(
    engine: AsyncEngine, requests: list[EngineRequest]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(choice index, output)`` as each choice's outputs arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def run(index: int, request: EngineRequest) -> None:
        try:
            async for output in engine.generate(request):
                queue.put_nowait((index, output))
        except Exception as exc:  # the stream ends with it: the first error wins
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.ensure_future(run(i, r)) for i, r in enumerate(requests)]
    running = len(tasks)
    try:
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choices(
    engine: AsyncEngine, requests: list[EngineRequest], n: int
) -> list[Choice]:
    choices = [Choice(index=i, prompt_index=i // n) for i in range(len(requests))]
    async for index, output in stream_choices(engine, requests):
        choices[index].add(output)
    return choices
