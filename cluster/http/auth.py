"""The API key check, as plain ASGI middleware: the /v1 routes need ``Authorization: Bearer
<key>``; /health, /version and /metrics do not (probes and scrapers have no key), as with
vLLM. Plain ASGI rather than Starlette's BaseHTTPMiddleware, which wraps ``receive`` and would
hide a client's disconnect from the routes that watch for it."""

from __future__ import annotations

import hmac

from cluster.http.errors import UnauthorizedError, error_response

MISSING_KEY = "Missing or wrong API key: send 'Authorization: Bearer <key>'."


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, self._expected):
                response = error_response(UnauthorizedError(MISSING_KEY))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
