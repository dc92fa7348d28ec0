"""The OpenAI-compatible routes over one engine: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (server-sent events when streamed, ending with ``data: [DONE]``),
and ``/health``, ``/version``, ``/metrics``, which need no API key (probes and scrapers have
none), as with vLLM. Errors are OpenAI error bodies, statuses from ``cluster.http.errors``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.chat import chat_prompt
from cluster.engine import AsyncEngine
from cluster.http.auth import ApiKeyMiddleware
from cluster.http.body import read_request
from cluster.http.choices import Choice, collect_choices, prepare_choices, stream_choices
from cluster.http.disconnect import unless_disconnected
from cluster.http.errors import ModelNotFoundError, error_of, install_error_handlers
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.http.responses import ResponseWriter, sse
from cluster.http.structured import structured_outputs, tool_mode
from cluster.validation import InvalidRequestError

CLIENT_GONE = 499  # the status nobody reads: the client disconnected before the answer


def kvray_version() -> str:
    try:
        return version("kvray")
    except PackageNotFoundError:
        return "unknown"


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None,
    max_model_len: int,
    max_request_bytes: int,
    tool_call_parser: str | None = None,
) -> FastAPI:
    app = FastAPI(title="kvray", version=kvray_version(), docs_url=None, redoc_url=None)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    install_error_handlers(app)
    add_probe_routes(app, engine)
    add_openai_routes(app, engine, model_name, max_model_len, max_request_bytes, tool_call_parser)
    return app


def add_probe_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """What probes and scrapers read, with no API key."""

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


def add_openai_routes(
    app: FastAPI,
    engine: AsyncEngine,
    model_name: str,
    max_model_len: int,
    max_request_bytes: int,
    tool_call_parser: str | None,
) -> None:
    created = int(time.time())

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
    async def completions(request: Request):
        body = await read_request(request, CompletionRequest, max_request_bytes)
        check_model(body.model)
        body.refuse_unsupported()
        fields = body.sampling_fields(body.logprobs)
        constraint, origin = structured_outputs(body, None)
        requests = await prepare_constrained(
            engine, body.prompts(), fields, constraint, origin, body.n, body.cache_salt
        )
        writer = ResponseWriter("completion", model_name, engine.tokenizer)
        return await respond(request, engine, writer, requests, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_request(request, ChatCompletionRequest, max_request_bytes)
        check_model(body.model)
        body.refuse_unsupported()
        mode = tool_mode(body, tool_call_parser)
        constraint, origin = structured_outputs(body, mode)
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:  # the template describes them to the model, under tool_choice "none" too
            template_kwargs["tools"] = body.template_tools()
        prompt = await chat_prompt(
            engine.tokenizer,
            body.conversation(),
            max_model_len=max_model_len,
            add_generation_prompt=body.add_generation_prompt,
            template_kwargs=template_kwargs,
        )
        requests = await prepare_constrained(
            engine, [prompt], body.sampling_fields(), constraint, origin, body.n, body.cache_salt
        )
        writer = ResponseWriter("chat", model_name, engine.tokenizer, mode)
        return await respond(request, engine, writer, requests, body)


async def prepare_constrained(engine, prompts, fields, constraint, origin, n, cache_salt):
    """The choices of a request whose output may be constrained; a constraint that does not
    compile is refused naming the field it came from."""
    if constraint is not None:
        fields = {**fields, "structured_outputs": constraint}
    try:
        return await prepare_choices(engine, prompts, fields, n, cache_salt)
    except InvalidRequestError as exc:
        if (
            origin
            and origin != "structured_outputs"
            and (exc.param or "").startswith("structured_outputs")
        ):
            raise InvalidRequestError(str(exc), param=origin) from None
        raise


async def respond(request: Request, engine, writer: ResponseWriter, requests, body):
    n = body.n
    if not body.stream:
        answered, choices = await unless_disconnected(request, collect_choices(engine, requests, n))
        if not answered:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(writer.response(choices, n))
    events = stream_events(engine, writer, requests, n, body.include_usage)
    # Refusals (a full queue...) before the first event become statuses, not 200s.
    answered, first = await unless_disconnected(request, anext(events))
    if not answered:
        return Response(status_code=CLIENT_GONE)
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
    except Exception as exc:
        if not started:
            raise
        yield sse(error_of(exc)[1])
    if include_usage:
        yield writer.usage_chunk(choices, n)
    yield sse("[DONE]")


async def _chain(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for event in rest:
        yield event
