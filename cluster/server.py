"""The gRPC edge: converts messages and delegates to the engine; one table maps the engine's
errors to status codes. Binds 127.0.0.1 unless told otherwise; with an API key, every call
except the health service needs ``authorization: Bearer <key>``. Requests larger than
``--max-request-body`` and messages that do not parse are refused as the transport's
RESOURCE_EXHAUSTED / INVALID_ARGUMENT, before any engine work."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.api.v1 import kvray_pb2 as pb
from cluster.api.v1 import kvray_pb2_grpc as pb_grpc
from cluster.chat import chat_prompt
from cluster.engine import AsyncEngine, RequestOutput
from cluster.errors import (
    EngineInternalError,
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
)
from workers.sampling import SAMPLING_FIELDS
from workers.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)
SERVICE_NAME = "kvray.v1.Engine"
# The proto's `optional` scalars, whose presence says whether the request set them.
OPTIONAL_FIELDS = frozenset(
    field.name for field in pb.SamplingParams.DESCRIPTOR.fields if field.has_presence
) - {"stop", "stop_token_ids", "structured_outputs"}
# The engine's errors as gRPC status codes (subclasses first).
STATUS_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),  # EngineDeadError too
    (EngineInternalError, grpc.StatusCode.INTERNAL),
]


def sampling_from_proto(request: pb.GenerateRequest) -> dict:
    """The sampling fields the request sets (the engine fills in the rest)."""
    message = request.sampling
    fields = {
        name: getattr(message, name)
        for name in SAMPLING_FIELDS
        if name in OPTIONAL_FIELDS and message.HasField(name)
    }
    for name in ("stop", "stop_token_ids"):
        if getattr(message, name):
            fields[name] = tuple(getattr(message, name))
    if message.ignore_eos:
        fields["ignore_eos"] = True
    if message.HasField("structured_outputs"):
        fields["structured_outputs"] = structured_from_proto(message.structured_outputs)
    return fields


def structured_from_proto(message: pb.StructuredOutputs) -> StructuredOutputs:
    """The constraint the message sets (none set: refused as such when it is checked)."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        return StructuredOutputs()
    if kind == "choice":
        return StructuredOutputs(choice=tuple(message.choice.choices))
    return StructuredOutputs(**{kind: getattr(message, kind)})


def response_from_output(output: RequestOutput) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=output.request_id,
        token_ids=output.token_ids,
        text=output.text,
        finish_reason=output.finish_reason or "",
    )
    for entry in output.logprobs or ():
        response.logprobs.add(
            logprob=entry.logprob,
            top_token_ids=[token for token, _ in entry.top],
            top_logprobs=[value for _, value in entry.top],
        )
    if output.finish_reason is not None:
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=output.prompt_tokens,
                completion_tokens=output.completion_tokens,
                cached_prompt_tokens=output.cached_prompt_tokens,
            )
        )
    return response


class UnreadableMessage:
    """What a request that does not parse (invalid UTF-8 in a string, a broken field) turns
    into, so the servicer can refuse it by name instead of the transport's bare INTERNAL."""

    def __init__(self, reason: str):
        self.reason = reason


def tolerant_parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return UnreadableMessage(str(exc))

    return parse


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(self, engine: AsyncEngine, describe: Callable[[], pb.ServerInfo]):
        self.engine = engine
        self.describe = describe  # GetServerInfo's answer, now

    async def Generate(self, request, context):
        try:
            _refuse_unreadable(request)
            kind = request.WhichOneof("prompt")
            if kind is None:
                raise InvalidRequestError("Give a prompt: text, token_ids or conversation.")
            _refuse_unknown_fields(request)
            if kind == "conversation":
                messages = [
                    {"role": m.role, "content": m.content} for m in request.conversation.messages
                ]
                prompt = await chat_prompt(
                    self.engine.tokenizer, messages, max_model_len=self.engine.max_model_len
                )
            else:
                prompt = request.text if kind == "text" else list(request.token_ids.ids)
            engine_request = await self.engine.prepare(
                prompt,
                self.engine.sampling_params(sampling_from_proto(request)),
                request.request_id or None,
                cache_salt=request.cache_salt or None,
            )
            async for output in self.engine.generate(engine_request):
                yield response_from_output(output)
        except tuple(error for error, _ in STATUS_CODES) as exc:
            await context.abort(status_code(exc), str(exc))

    async def Abort(self, request, context):
        if isinstance(request, UnreadableMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return pb.AbortResponse(aborted=self.engine.abort(request.request_id))

    async def GetServerInfo(self, request, context):
        try:
            return self.describe()
        except tuple(error for error, _ in STATUS_CODES) as exc:
            await context.abort(status_code(exc), str(exc))


def status_code(error: Exception) -> grpc.StatusCode:
    return next(code for kind, code in STATUS_CODES if isinstance(error, kind))


def add_engine_service(server, servicer: EngineServicer) -> None:
    """The generated registration, with parsers that hand unreadable requests to the
    servicer."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=tolerant_parser(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort,
            request_deserializer=tolerant_parser(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo,
            request_deserializer=tolerant_parser(pb.GetServerInfoRequest),
            response_serializer=pb.ServerInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _refuse_unreadable(request) -> None:
    if isinstance(request, UnreadableMessage):
        raise InvalidRequestError(
            f"The request does not parse as a GenerateRequest: {request.reason}"
        )


def _refuse_unknown_fields(message) -> None:
    from google.protobuf import unknown_fields

    for part in (message, message.sampling):
        if len(unknown_fields.UnknownFieldSet(part)):
            raise InvalidRequestError(
                "The request has fields this server does not know (a newer client?); "
                "known GenerateRequest fields: request_id, text, token_ids, conversation, "
                "sampling, cache_salt."
            )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every kvray call needs the key; the health service never does (probes have no key)."""

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

        async def deny(request, context):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "Missing or wrong API key: send 'authorization: Bearer <key>'.",
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode(), self._expected):
            return await continuation(details)
        return self._deny_stream if details.method.endswith("/Generate") else self._deny_unary


class ApiServer:
    def __init__(
        self,
        engine: AsyncEngine,
        describe: Callable[[], pb.ServerInfo],
        *,
        host: str,
        port: int,
        api_key: str | None,
        max_request_bytes: int,
    ):
        interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", max_request_bytes)],
        )
        add_engine_service(self.server, EngineServicer(engine, describe))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC server to {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)
        logger.info("kvray gRPC API on %s", self.address)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace: float = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)
