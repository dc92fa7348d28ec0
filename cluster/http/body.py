"""Reading a request body: never more than ``--max-request-body`` bytes (413 from the
Content-Length header alone, or as soon as a streamed body passes the limit), then JSON, then
the route's pydantic model. Every way a body can be wrong is an InvalidRequestError that says
how, so the error handlers answer with an OpenAI error body, never a framework's own."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from cluster.http.errors import RequestTooLargeError, invalid_fields
from cluster.validation import InvalidRequestError

Model = TypeVar("Model", bound=BaseModel)


async def read_request(request: Request, model: type[Model], max_bytes: int) -> Model:
    return validated(model, parse_json(await read_body(request, max_bytes)))


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLargeError(too_large(f"{int(declared)} bytes", max_bytes))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLargeError(too_large(f"more than {max_bytes} bytes", max_bytes))
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: str, max_bytes: int) -> str:
    return (
        f"The request body is {size}; this server reads at most {max_bytes} bytes "
        "(kvray serve --max-request-body)."
    )


def parse_json(body: bytes):
    try:
        return json.loads(body)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not UTF-8: {exc.reason} at byte {exc.start}."
        ) from None
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column "
            f"{exc.colno})."
        ) from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise InvalidRequestError(f"The request body does not parse: {exc}") from None
    except RecursionError:
        raise InvalidRequestError("The request body nests too deeply to parse.") from None


def validated(model: type[Model], data) -> Model:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_fields(exc.errors()) from None
