"""The OpenAI HTTP API's test rig: the tiny chat model served in process with both front ends,
and what tests read off it (statuses, error bodies, blocks, metrics)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import EngineConfig
from cluster.local import LocalServer
from tests.cluster.chat_model import save_chat_model

KEY = "s3cret"
MODEL = "tiny-chat"
VOCAB = 300  # the chat model's
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def url(server, path: str) -> str:
    return f"http://{server.http.address}{path}"


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    return httpx.post(url(server, path), content=content, headers=HEADERS, timeout=60, **kwargs)


def engine_stats(server) -> dict:
    async def read():
        engine = server.engine
        pool = engine.scheduler.coordinator
        return {
            "free": pool.num_free_blocks,
            "usable": pool.block_pool.num_blocks - 1,
            "in_flight": engine.num_in_flight,
            "rebuilds": engine.num_rebuilds,
        }

    return server.run(read())


def wait_until_idle(server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(server)
        done = stats["in_flight"] == 0 and stats["free"] == stats["usable"]
        if done or time.monotonic() > deadline:
            return stats


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["message"] and error["type"].endswith("Error")
    return error


COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@contextlib.contextmanager
def chat_server(directory: Path):
    """The chat model behind an API key, HTTP and gRPC on free ports, 256 tokens of context."""
    config = EngineConfig(
        model=str(save_chat_model(directory)),
        kv_cache_memory_bytes=8 << 20,
        port=0,
        http_port=0,
        max_model_len=256,
        api_key=KEY,
        served_model_name=MODEL,
    )
    with LocalServer(config) as running:
        yield running


def metrics(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url(server, "/metrics")).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def chat_answer(client, call: dict, stream: bool) -> tuple[str, str]:
    """(content, finish reason) of one chat completion through the openai client, whole or
    gathered from its stream."""
    if not stream:
        choice = client.chat.completions.create(**call).choices[0]
        return choice.message.content, choice.finish_reason
    stream_chunks = client.chat.completions.create(**call, stream=True)
    chunks = [chunk.choices[0] for chunk in stream_chunks if chunk.choices]
    return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
