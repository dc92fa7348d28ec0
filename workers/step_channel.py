"""The step channel: a TCP connection from the controller straight to one worker actor, that
carries step plans in and step results out (``--step-transport socket``).

A Ray actor call costs about 0.6 ms between one step's end and the next's start at the actor
even with the next call already queued (measured on two cores: the call's result goes
through Ray's core worker, the next task is dispatched from it); Ray Compiled Graphs cut that,
but their channel readers spin on a core each, which a CPU worker computes with. Over the
channel a step that has already arrived starts 0.06 ms after the last one ended, and a
waiting worker blocks in ``select`` instead of spinning.

Frames both ways: a 4-byte little-endian length, one status byte (``OK`` or ``FAILED``,
whose payload is the error's text), the payload (msgspec bytes). The listener accepts one
connection, the first to send the 16-byte token the actor handed its owner through an
authenticated Ray call; anything else that connects is dropped.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading

logger = logging.getLogger(__name__)
HEADER = struct.Struct("<IB")
OK, FAILED = 0, 1
TOKEN_BYTES = 16
AUTH_TIMEOUT_S = 10.0


def frame(status: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), status) + payload


def split_frames(buffer: bytearray) -> list[tuple[int, bytes]]:
    """The complete frames at the start of ``buffer``, removed from it (a partial frame stays
    for the bytes still to come)."""
    frames, start = [], 0
    while len(buffer) - start >= HEADER.size:
        length, status = HEADER.unpack_from(buffer, start)
        end = start + HEADER.size + length
        if end > len(buffer):
            break
        frames.append((status, bytes(buffer[start + HEADER.size : end])))
        start = end
    del buffer[:start]
    return frames


def no_delay(sock: socket.socket) -> None:
    """Small frames go out at once (Nagle's algorithm would hold a reply for the next ACK)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ChannelListener:
    """A listening socket on ``host`` and the token its one connection must present."""

    def __init__(self, host: str):
        self.token = secrets.token_bytes(TOKEN_BYTES)
        # No deadline to connect: the owner connects at its first step, which waits for the
        # first request (hours, on a quiet server).
        self._socket = socket.create_server((host, 0))
        self.address = self._socket.getsockname()[:2]

    def accept_in_background(self, on_connected) -> None:
        """Accept the owner's connection on a thread of its own, then hand it to
        ``on_connected`` (which takes it over); the listener closes either way."""
        threading.Thread(
            target=self._accept, args=(on_connected,), name="kvray-step-accept", daemon=True
        ).start()

    def _accept(self, on_connected) -> None:
        try:
            while True:
                conn, peer = self._socket.accept()
                if self._authenticated(conn):
                    conn.settimeout(None)
                    no_delay(conn)
                    on_connected(conn)
                    return
                logger.warning("Dropped a step-channel connection from %s: bad token", peer)
                conn.close()
        except OSError as exc:
            logger.warning("The step channel was never connected: %s", exc)
        finally:
            self._socket.close()

    def _authenticated(self, conn: socket.socket) -> bool:
        conn.settimeout(AUTH_TIMEOUT_S)
        received = b""
        try:
            while len(received) < TOKEN_BYTES:
                chunk = conn.recv(TOKEN_BYTES - len(received))
                if not chunk:
                    return False
                received += chunk
        except OSError:
            return False
        return hmac.compare_digest(received, self.token)
