"""Work that stops when its client goes away. A non-streamed response is written only at the
end, so nothing else would notice a client that disconnected: the generation would run on to
``max_tokens`` and hold its blocks. (Streams notice by themselves: Starlette cancels a
streaming response whose client left.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """``(True, work's result)``, or ``(False, None)`` once the client has disconnected, with
    ``work`` cancelled (cancelling a generation aborts its engine requests, which frees their
    blocks). The request's body must have been read already."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
