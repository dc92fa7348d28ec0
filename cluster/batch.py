"""Offline batch generation: a JSONL file of prompts in, a JSONL file of results out.

Each input line is a JSON object with ``prompt`` (text) or ``prompt_token_ids`` (a list of
ints), an optional ``id``, and optional sampling fields (``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``). Each output line
answers the input line of the same position: ``{"line", "id", "text", "token_ids",
"finish_reason", "usage"}``, or ``{"line", "id", "error"}`` for a line that could not run.
Results are written in input order as they complete, so an interrupted run resumes where its
output file ends.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cluster.client import SAMPLING_KEYS, AsyncClient, InvalidRequestError

PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass(frozen=True)
class BatchSummary:
    num_lines: int
    num_skipped: int  # already in the output file (resumed)
    num_succeeded: int
    num_failed: int


def parse_line(line_number: int, raw: str) -> tuple[str | list[int], dict, object]:
    """(prompt, sampling, id) of one input line; ValueError says what is wrong."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {line_number}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"line {line_number}: expected a JSON object")
    unknown = set(record) - SAMPLING_KEYS - set(PROMPT_KEYS) - {"id"}
    if unknown:
        raise ValueError(f"line {line_number}: unknown field(s) {sorted(unknown)}")
    prompts = [key for key in PROMPT_KEYS if key in record]
    if len(prompts) != 1:
        raise ValueError(f"line {line_number}: give exactly one of 'prompt' or 'prompt_token_ids'")
    prompt = record[prompts[0]]
    if prompts[0] == "prompt" and not isinstance(prompt, str):
        raise ValueError(f"line {line_number}: 'prompt' must be a string")
    if prompts[0] == "prompt_token_ids" and not (
        isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    ):
        raise ValueError(f"line {line_number}: 'prompt_token_ids' must be a list of integers")
    sampling = {key: record[key] for key in SAMPLING_KEYS if key in record}
    return prompt, sampling, record.get("id")


def completed_lines(output: Path) -> int:
    """How many whole result lines ``output`` already holds (a torn last line is dropped)."""
    if not output.exists():
        return 0
    data = output.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        output.write_bytes(keep)
    return keep.count(b"\n")


async def _run_one(client: AsyncClient, line_number: int, raw: str) -> dict:
    try:
        prompt, sampling, request_id = parse_line(line_number, raw)
    except ValueError as exc:
        return {"line": line_number, "id": None, "error": str(exc)}
    try:
        done = await client.generate(prompt, **sampling)
    except (InvalidRequestError, TypeError) as exc:
        return {"line": line_number, "id": request_id, "error": f"line {line_number}: {exc}"}
    return {
        "line": line_number,
        "id": request_id,
        "text": done.text,
        "token_ids": done.token_ids,
        "finish_reason": done.finish_reason,
        "usage": vars(done.usage),
    }


async def run_batch_async(
    address: str,
    input_path: str | Path,
    output_path: str | Path,
    *,
    api_key: str | None = None,
    concurrency: int = 64,
    show_progress: bool = True,
) -> BatchSummary:
    """Run every line of ``input_path`` against the server at ``address``."""
    lines = Path(input_path).read_text().splitlines()
    output = Path(output_path)
    skipped = completed_lines(output)
    todo = list(enumerate(lines, start=1))[skipped:]
    progress = tqdm(
        total=len(lines),
        initial=skipped,
        desc="kvray batch",
        unit="prompt",
        disable=not show_progress,
        file=sys.stderr,
    )
    gate = asyncio.Semaphore(concurrency)
    succeeded = failed = 0
    async with AsyncClient(address, api_key=api_key) as client:

        async def guarded(line_number: int, raw: str) -> dict:
            async with gate:
                return await _run_one(client, line_number, raw)

        tasks = [asyncio.ensure_future(guarded(n, raw)) for n, raw in todo]
        with output.open("a") as sink:
            for task in tasks:  # in input order; later lines keep running meanwhile
                result = await task
                sink.write(json.dumps(result) + "\n")
                sink.flush()
                progress.update(1)
                if "error" in result:
                    failed += 1
                    print(f"kvray batch: {result['error']}", file=sys.stderr)
                else:
                    succeeded += 1
    progress.close()
    return BatchSummary(len(lines), skipped, succeeded, failed)


def run_batch(
    address: str, input_path: str | Path, output_path: str | Path, **options
) -> BatchSummary:
    """Synchronous ``run_batch_async``."""
    return asyncio.run(run_batch_async(address, input_path, output_path, **options))
