"""The one thread a worker actor runs torch on (see ``workers.actor`` for why one), serving
both the actor's calls and, once connected, its step channel (``workers.step_channel``).

The thread waits in ``select`` on a wake-up pipe (a call was queued) and the channel's socket
(frames arrived). Steps run on this thread with no hand-over, so a step already waiting
starts as soon as the one before has replied; calls queued meanwhile run between steps.
"""

from __future__ import annotations

import logging
import os
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future

from workers.step_channel import FAILED, OK, frame, split_frames

logger = logging.getLogger(__name__)
READ_BYTES = 1 << 16


class TorchThread:
    def __init__(self, name: str = "kvray-torch"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._channel: socket.socket | None = None
        self._serve_step: Callable[[bytes], bytes] | None = None
        self._pending = bytearray()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def run(self, function, *args):
        """``function(*args)`` on this thread; its result, or its exception raised here."""
        future: Future = Future()
        self._calls.put((future, function, args))
        os.write(self._wake_write, b"\0")
        return future.result()

    def serve_channel(self, conn: socket.socket, serve_step: Callable[[bytes], bytes]) -> None:
        """From any thread: answer each frame of ``conn`` with ``serve_step`` from now on."""
        self.run(self._attach, conn, serve_step)

    @property
    def has_channel(self) -> bool:
        return self._channel is not None

    def _attach(self, conn: socket.socket, serve_step) -> None:
        self._detach()  # a new owner (a rebuilt controller) replaces the old connection
        conn.setblocking(True)
        self._channel, self._serve_step = conn, serve_step
        self._pending.clear()
        self._selector.register(conn, selectors.EVENT_READ)

    def _detach(self) -> None:
        if self._channel is not None:
            self._selector.unregister(self._channel)
            self._channel.close()
            self._channel = self._serve_step = None

    def _loop(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.fileobj == self._wake_read:
                    os.read(self._wake_read, READ_BYTES)
                    self._run_calls()
                elif self._channel is not None:
                    self._read_channel()

    def _run_calls(self) -> None:
        while not self._calls.empty():
            future, function, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # the caller re-raises it
                future.set_exception(exc)

    def _read_channel(self) -> None:
        try:
            data = self._channel.recv(READ_BYTES)
        except OSError:
            data = b""
        if not data:  # the owner went away
            self._detach()
            return
        self._pending += data
        for status, payload in split_frames(self._pending):
            if status != OK or not self._answer(payload):
                self._detach()
                return
            self._run_calls()  # health checks and the like wait for no more than a step

    def _answer(self, payload: bytes) -> bool:
        """Run one step and send its reply (a failure's text, when it raises); False once
        the connection is gone."""
        try:
            reply = frame(OK, self._serve_step(payload))
        except Exception as exc:
            logger.exception("A step sent over the step channel failed")
            reply = frame(FAILED, repr(exc).encode())
        try:
            self._channel.sendall(reply)
        except OSError:
            return False
        return True
