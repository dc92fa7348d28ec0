"""Serving the HTTP app with uvicorn on the event loop the engine and gRPC already run on.

The socket is bound here, before uvicorn starts, so a port in use is a clear error at
startup and port 0 is resolved at once. uvicorn's signal handling stays off: the process that
owns the engine decides what SIGTERM means (a drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


class HttpServer:
    def __init__(self, app, *, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise OSError(f"cannot bind the HTTP server to {host}:{port}: {exc.strerror}") from None
        self._socket.listen(2048)
        self.port = self._socket.getsockname()[1]
        self.address = f"{host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._server.capture_signals = contextlib.nullcontext  # see the module docstring
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():  # it failed to start: say why
                await self._task
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close()
