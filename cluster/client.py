"""The kvray Python client: gRPC to a running server. Imports neither torch nor ray, so it
installs and runs anywhere Python and grpcio do.

    from cluster.client import Client
    with Client("127.0.0.1:50051") as client:
        print(client.generate("Hello", max_tokens=8, temperature=0).text)
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        print(client.generate(chat, max_tokens=16, temperature=0).text)
        for delta in client.stream([1, 2, 3], max_tokens=8):
            print(delta.token_ids)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.api.v1 import kvray_pb2 as pb
from cluster.api.v1 import kvray_pb2_grpc as pb_grpc
from workers.sampling import SAMPLING_FIELDS  # msgspec only: no torch

SAMPLING_KEYS = frozenset(SAMPLING_FIELDS)


class KVRayError(Exception):
    """A call the server refused or could not complete; ``code`` is the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class InvalidRequestError(KVRayError):
    """The request was malformed (bad sampling values, a prompt too long, ...)."""


class RequestTooLargeError(InvalidRequestError):
    """The request is larger than the server takes (its ``--max-request-body``): gRPC says
    RESOURCE_EXHAUSTED, as for a full queue, but retrying cannot help."""


class OverloadedError(KVRayError):
    """The server's queue is full; retry later."""


class UnavailableError(KVRayError):
    """The server is unreachable, shutting down, or lost a worker."""


class UnauthenticatedError(KVRayError):
    """A missing or wrong API key."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


def _translate(error: grpc.RpcError) -> KVRayError:
    code = error.code()
    details = error.details() or str(code)
    # gRPC refuses an oversized message with the status of an overloaded server.
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return RequestTooLargeError(
            f"{details}: the request is larger than the server accepts (its "
            "--max-request-body); shorten it",
            code,
        )
    return _ERRORS.get(code, KVRayError)(details, code)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class Delta:
    """What one streamed message adds: new tokens and text; the last one finishes."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when asked for


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprobs] | None = None


def build_request(
    prompt: str | Sequence[int] | Sequence[dict],
    request_id: str | None,
    sampling: dict,
    cache_salt: str | None = None,
):
    unknown = set(sampling) - SAMPLING_KEYS
    if unknown:
        raise TypeError(
            f"Unknown sampling keyword(s) {sorted(unknown)}; valid: {sorted(SAMPLING_KEYS)}"
        )
    # What protobuf cannot hold (text UTF-8 cannot encode, integers past 64 bits) is refused
    # here, as the server would refuse it, naming the field.
    with _refused_as("request_id or cache_salt"):
        request = pb.GenerateRequest(request_id=request_id or "", cache_salt=cache_salt or "")
    with _refused_as("prompt"):
        if isinstance(prompt, str):
            request.text = prompt
        elif prompt and isinstance(prompt[0], dict):  # a conversation: the template applies
            for message in prompt:
                request.conversation.messages.add(role=message["role"], content=message["content"])
        else:
            request.token_ids.ids.extend(int(t) for t in prompt)
    for key, value in sampling.items():
        if value is None:
            continue
        with _refused_as(key):
            if key in ("stop", "stop_token_ids"):
                getattr(request.sampling, key).extend([value] if isinstance(value, str) else value)
            elif key == "structured_outputs":
                set_structured_outputs(request.sampling.structured_outputs, value)
            else:
                setattr(request.sampling, key, value)
    return request


@contextlib.contextmanager
def _refused_as(field: str):
    try:
        yield
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{field} is not valid Unicode text ({exc.reason} at character {exc.start}); "
            "send text UTF-8 can encode",
            grpc.StatusCode.INVALID_ARGUMENT,
        ) from None
    except ValueError as exc:  # protobuf: an integer out of its field's range
        raise InvalidRequestError(f"{field}: {exc}", grpc.StatusCode.INVALID_ARGUMENT) from None


def set_structured_outputs(message, constraint: dict) -> None:
    """``constraint`` is one of ``{"json": schema}`` (a dict, or its JSON text),
    ``{"json_object": True}``, ``{"regex": ...}``, ``{"choice": [...]}`` or
    ``{"grammar": ...}`` (EBNF), as vLLM's ``structured_outputs`` spells them."""
    if not isinstance(constraint, dict) or len(constraint) != 1:
        raise TypeError(
            "structured_outputs takes one of {'json': ...}, {'json_object': True}, "
            f"{{'regex': ...}}, {{'choice': [...]}}, {{'grammar': ...}}; got {constraint!r}"
        )
    ((kind, value),) = constraint.items()
    if kind == "json":
        message.json = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        message.choice.choices.extend(value)
    elif kind in ("json_object", "regex", "grammar"):
        setattr(message, kind, value)
    else:
        raise TypeError(f"structured_outputs has no kind {kind!r}")


def _delta(message: pb.GenerateResponse) -> Delta:
    usage = None
    if message.HasField("usage"):
        u = message.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    logprobs = [
        TokenLogprobs(
            entry.logprob, list(zip(entry.top_token_ids, entry.top_logprobs, strict=True))
        )
        for entry in message.logprobs
    ]
    return Delta(
        message.request_id,
        list(message.token_ids),
        message.text,
        message.finish_reason or None,
        usage,
        logprobs or None,
    )


def _collect(deltas: list[Delta]) -> Completion:
    last = deltas[-1]
    return Completion(
        request_id=last.request_id,
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        finish_reason=last.finish_reason or "abort",
        usage=last.usage or Usage(0, 0, 0),
        logprobs=[entry for d in deltas for entry in d.logprobs or ()] or None,
    )


def message_to_dict(message) -> dict:
    """Every field of ``message`` with Python values (ints stay ints, unlike proto JSON)."""
    result = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        is_message = field.type == field.TYPE_MESSAGE
        if field.is_repeated:
            value = [message_to_dict(v) if is_message else v for v in value]
        elif is_message:
            value = message_to_dict(value)
        result[field.name] = value
    return result


def _metadata(api_key: str | None):
    return None if api_key is None else (("authorization", f"Bearer {api_key}"),)


class Client:
    def __init__(self, address: str, api_key: str | None = None, timeout: float | None = None):
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _metadata(api_key)
        self.timeout = timeout

    def stream(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        **sampling,
    ) -> Iterator[Delta]:
        """Deltas as they are made. ``prompt`` is text, token ids, or a conversation (a list
        of ``{"role", "content"}`` messages, rendered with the model's chat template).
        ``cache_salt`` keeps the prompt out of the prefix-cache hits of requests with another
        salt (a tenant's own cache)."""
        request = build_request(prompt, request_id, sampling, cache_salt)
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        try:
            for message in call:
                yield _delta(message)
        except grpc.RpcError as error:
            raise _translate(error) from None
        finally:
            call.cancel()  # a caller that stops iterating aborts the request

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        **sampling,
    ) -> Completion:
        deltas = self.stream(prompt, request_id=request_id, cache_salt=cache_salt, **sampling)
        return _collect(list(deltas))

    def abort(self, request_id: str) -> bool:
        try:
            reply = self._stub.Abort(
                pb.AbortRequest(request_id=request_id),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise _translate(error) from None
        return reply.aborted

    def info(self) -> dict:
        try:
            reply = self._stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise _translate(error) from None
        return message_to_dict(reply)

    def health(self, service: str = "") -> str:
        """``"SERVING"`` or ``"NOT_SERVING"`` (no API key needed)."""
        try:
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout
            )
        except grpc.RpcError as error:
            raise _translate(error) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    def __init__(self, address: str, api_key: str | None = None, timeout: float | None = None):
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _metadata(api_key)
        self.timeout = timeout

    async def stream(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        **sampling,
    ) -> AsyncIterator[Delta]:
        request = build_request(prompt, request_id, sampling, cache_salt)
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        try:
            async for message in call:
                yield _delta(message)
        except grpc.RpcError as error:
            raise _translate(error) from None
        finally:
            call.cancel()

    async def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        **sampling,
    ) -> Completion:
        deltas = self.stream(prompt, request_id=request_id, cache_salt=cache_salt, **sampling)
        return _collect([d async for d in deltas])

    async def abort(self, request_id: str) -> bool:
        try:
            reply = await self._stub.Abort(
                pb.AbortRequest(request_id=request_id),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as error:
            raise _translate(error) from None
        return reply.aborted

    async def info(self) -> dict:
        try:
            reply = await self._stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise _translate(error) from None
        return message_to_dict(reply)

    async def health(self, service: str = "") -> str:
        """``"SERVING"`` or ``"NOT_SERVING"`` (no API key needed)."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout
            )
        except grpc.RpcError as error:
            raise _translate(error) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
