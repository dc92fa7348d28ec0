"""The OpenAI-compatible routes over one engine: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (server-sent events when streamed, ending with ``data: [DONE]``),
and ``/health``, ``/version``, ``/metrics``, which need no API key (probes and scrapers have
none), as with vLLM. Errors are OpenAI error bodies, statuses from ``cluster.http.errors``.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.chat import chat_prompt
from cluster.engine import AsyncEngine
from cluster.http.choices import Choice, collect_choices, prepare_choices, stream_choices
from cluster.http.errors import (
    HANDLED,
    ModelNotFoundError,
    UnauthorizedError,
    error_body,
    error_response,
    status_of,
)
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.http.responses import ResponseWriter, sse
from cluster.validation import InvalidRequestError

MISSING_KEY = "Missing or wrong API key: send 'Authorization: Bearer <key>'."


def kvray_version() -> str:
    try:
        return version("kvray")
    except PackageNotFoundError:
        return "unknown"


def build_app(
    engine: AsyncEngine, *, model_name: str, api_key: str | None, max_model_len: int
) -> FastAPI:
    app = FastAPI(title="kvray", version=kvray_version(), docs_url=None, redoc_url=None)
    created = int(time.time())
    expected_key = f"Bearer {api_key}".encode() if api_key else None

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if expected_key is not None and request.url.path.startswith("/v1/"):
            sent = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, expected_key):
                return error_response(UnauthorizedError(MISSING_KEY))
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return error_response(InvalidRequestError(f"Invalid request: {problems}"))

    for kind in HANDLED:
        app.add_exception_handler(kind, lambda request, exc: error_response(exc))

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_serving else 503)

    @app.get("/version")
    async def get_version():
        return {"version": kvray_version()}

    @app.get("/metrics")
    async def metrics():
        body = engine.metrics.render() if engine.metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "kvray",
                "root": model_name, "max_model_len": max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    def check_model(name: str) -> None:
        if name != model_name:
            raise ModelNotFoundError(f"The model `{name}` does not exist; this server serves "
                                     f"`{model_name}` (GET /v1/models).")  # fmt: skip

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        body.refuse_unsupported()
        requests = await prepare_choices(
            engine, body.prompts(), body.sampling_fields(body.logprobs), body.n, body.cache_salt
        )
        writer = ResponseWriter("completion", model_name, engine.tokenizer)
        return await respond(engine, writer, requests, body.n, body.stream, body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body.model)
        body.refuse_unsupported()
        prompt = await chat_prompt(
            engine.tokenizer,
            body.conversation(),
            add_generation_prompt=body.add_generation_prompt,
            template_kwargs=body.chat_template_kwargs or {},
        )
        requests = await prepare_choices(
            engine, [prompt], body.sampling_fields(), body.n, body.cache_salt
        )
        writer = ResponseWriter("chat", model_name, engine.tokenizer)
        return await respond(engine, writer, requests, body.n, body.stream, body.include_usage)

    return app


async def respond(engine, writer: ResponseWriter, requests, n: int, stream: bool, usage: bool):
    if not stream:
        return JSONResponse(writer.response(await collect_choices(engine, requests, n), n))
    events = stream_events(engine, writer, requests, n, usage)
    first = await anext(events)  # refusals (a full queue...) become statuses, not 200s
    return StreamingResponse(_chain(first, events), media_type="text/event-stream")


async def stream_events(engine, writer: ResponseWriter, requests, n: int, include_usage: bool):
    """Server-sent events: a chunk per engine output, usage last if asked, then [DONE]. An
    error once streaming has begun is an error event, then [DONE]."""
    choices = [Choice(index=i, prompt_index=i // n) for i in range(len(requests))]
    started = False
    try:
        async for index, output in stream_choices(engine, requests):
            choice = choices[index]
            is_first = not choice.token_ids and not choice.text
            choice.add(output)
            started = True
            yield writer.chunk(
                index, output.text, output.token_ids, output.logprobs, output.finish_reason,
                is_first,
            )  # fmt: skip
    except HANDLED as exc:
        if not started:
            raise
        status, kind = status_of(exc)
        yield sse(error_body(str(exc), status, kind))
    if include_usage:
        yield writer.usage_chunk(choices, n)
    yield sse("[DONE]")


async def _chain(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for event in rest:
        yield event
