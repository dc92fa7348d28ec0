"""The engine's errors as OpenAI error bodies with their HTTP status, in one table."""

from __future__ import annotations

from fastapi.responses import JSONResponse

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


# (error class, HTTP status, OpenAI-style type), subclasses first.
STATUSES: list[tuple[type[Exception], int, str]] = [
    (InvalidRequestError, 400, "BadRequestError"),
    (UnauthorizedError, 401, "AuthenticationError"),
    (ModelNotFoundError, 404, "NotFoundError"),
    (OverloadedError, 429, "RateLimitError"),
    (EngineUnavailableError, 503, "ServiceUnavailableError"),  # EngineDeadError too
    (EngineInternalError, 500, "InternalServerError"),
]
HANDLED = tuple(kind for kind, _, _ in STATUSES)


def error_body(message: str, status: int, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def status_of(error: Exception) -> tuple[int, str]:
    return next((status, kind) for cls, status, kind in STATUSES if isinstance(error, cls))


def error_response(error: Exception) -> JSONResponse:
    status, kind = status_of(error)
    return JSONResponse(error_body(str(error), status, kind), status_code=status)
