"""Every error the HTTP API answers, as an OpenAI error body (``{"error": {"message", "type",
"param", "code"}}``) with its status: the engine's errors in one table, the framework's own
(404, 405, a body FastAPI refused) and anything unexpected (500) through the same body."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cluster.errors import (
    EngineInternalError,
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
)


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve."""


class UnauthorizedError(PermissionError):
    """A missing or wrong API key."""


class RequestTooLargeError(ValueError):
    """The body is larger than --max-request-body; it was not read past the limit."""


# (error class, HTTP status, OpenAI-style type), subclasses first.
STATUSES: list[tuple[type[Exception], int, str]] = [
    (RequestTooLargeError, 413, "RequestTooLargeError"),
    (InvalidRequestError, 400, "BadRequestError"),
    (UnauthorizedError, 401, "AuthenticationError"),
    (ModelNotFoundError, 404, "NotFoundError"),
    (OverloadedError, 429, "RateLimitError"),
    (EngineUnavailableError, 503, "ServiceUnavailableError"),  # EngineDeadError too
    (EngineInternalError, 500, "InternalServerError"),
]
HANDLED = tuple(kind for kind, _, _ in STATUSES)
# The types of statuses the framework answers by itself.
FRAMEWORK_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError"}
MAX_LISTED = 5  # problems named in one refusal of a body's fields


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_of(error: Exception) -> tuple[int, dict]:
    """``error``'s status and body; an error outside the table is the server's (500)."""
    for cls, status, kind in STATUSES:
        if isinstance(error, cls):
            return status, error_body(str(error), status, kind, getattr(error, "param", None))
    message = f"The server failed on this request: {type(error).__name__}: {error}"
    return 500, error_body(message, 500, "InternalServerError")


def error_response(error: Exception) -> JSONResponse:
    status, body = error_of(error)
    return JSONResponse(body, status_code=status)


def invalid_fields(errors) -> InvalidRequestError:
    """One refusal naming the fields at fault (pydantic's or FastAPI's error list)."""

    def where(error) -> str:
        loc = [str(part) for part in error["loc"] if part != "body"]
        return ".".join(loc) or "body"

    problems = "; ".join(f"{where(e)}: {e['msg']}" for e in errors[:MAX_LISTED])
    if len(errors) > MAX_LISTED:
        problems += f"; and {len(errors) - MAX_LISTED} more"
    param = where(errors[0]) if errors else None
    return InvalidRequestError(f"Invalid request: {problems}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error ``app`` can raise to an OpenAI error body."""
    for kind in HANDLED:
        app.add_exception_handler(kind, lambda request, exc: error_response(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc: RequestValidationError):
        return error_response(invalid_fields(exc.errors()))

    @app.exception_handler(HTTPException)
    async def framework_error(request, exc: HTTPException):
        status = exc.status_code
        kind = FRAMEWORK_TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return JSONResponse(
            error_body(message, status, kind), status_code=status, headers=exc.headers
        )

    # Anything else is a 500 with the same body; Starlette logs it after this answer.
    app.add_exception_handler(Exception, lambda request, exc: error_response(exc))
