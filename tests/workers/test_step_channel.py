"""The step channel's worker end on real loopback sockets: the listener lets in only its
token's holder, the torch thread answers frames in order on itself, runs calls between steps,
reports a failed step by its text and keeps serving calls once the owner is gone."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from workers.step_channel import FAILED, HEADER, OK, ChannelListener, frame, split_frames
from workers.torch_thread import TorchThread


def read_frame(conn: socket.socket) -> tuple[int, bytes]:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            assert chunk, "the channel closed"
            data += chunk
        return data

    length, status = HEADER.unpack(exactly(HEADER.size))
    return status, exactly(length)


def refused(address) -> bool:
    try:
        socket.create_connection(address, timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_frames_split_where_they_end_and_a_partial_one_waits():
    buffer = bytearray(frame(OK, b"one") + frame(FAILED, b"") + frame(OK, b"three")[:-2])
    assert split_frames(buffer) == [(OK, b"one"), (FAILED, b"")]
    buffer += b"ee"
    assert split_frames(buffer) == [(OK, b"three")] and not buffer


@pytest.fixture
def served():
    """A torch thread serving a connected socket pair with a step that records its thread."""
    torch_thread = TorchThread()
    threads = []

    def step(payload: bytes) -> bytes:
        threads.append(threading.current_thread().name)
        if payload == b"fail":
            raise ValueError("bad plan")
        return payload[::-1]

    ours, theirs = socket.socketpair()
    torch_thread.serve_channel(theirs, step)
    yield torch_thread, ours, threads
    ours.close()


def test_steps_sent_back_to_back_are_answered_in_order_on_the_torch_thread(served):
    torch_thread, conn, threads = served
    conn.sendall(b"".join(frame(OK, f"step {i}".encode()) for i in range(5)))
    replies = [read_frame(conn) for _ in range(5)]
    assert replies == [(OK, f"step {i}".encode()[::-1]) for i in range(5)]
    assert set(threads) == {torch_thread.run(lambda: threading.current_thread().name)}


def test_a_failed_step_replies_with_its_error_and_the_channel_goes_on(served):
    _, conn, _ = served
    conn.sendall(frame(OK, b"fail") + frame(OK, b"ok"))
    status, text = read_frame(conn)
    assert status == FAILED and "bad plan" in text.decode()
    assert read_frame(conn) == (OK, b"ko")


def test_calls_run_between_steps_and_after_the_owner_leaves(served):
    torch_thread, conn, _ = served
    assert torch_thread.has_channel
    conn.sendall(frame(OK, b"abc"))
    assert torch_thread.run(lambda x: x + 1, 41) == 42
    assert read_frame(conn) == (OK, b"cba")
    conn.close()
    deadline = time.monotonic() + 5
    while torch_thread.has_channel and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not torch_thread.has_channel
    with pytest.raises(ZeroDivisionError):
        torch_thread.run(lambda: 1 / 0)
    assert torch_thread.run(lambda: "still serving") == "still serving"


def test_the_listener_drops_a_wrong_token_and_takes_the_right_one():
    listener = ChannelListener("127.0.0.1")
    connected = []
    done = threading.Event()
    listener.accept_in_background(lambda conn: (connected.append(conn), done.set()))
    stranger = socket.create_connection(listener.address)
    stranger.sendall(b"x" * len(listener.token))
    assert stranger.recv(1) == b""  # dropped
    owner = socket.create_connection(listener.address)
    owner.sendall(listener.token)
    assert done.wait(5) and len(connected) == 1
    connected[0].sendall(b"hello")
    assert owner.recv(5) == b"hello"
    deadline = time.monotonic() + 5  # one connection only: the listener closes
    while not refused(listener.address) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert refused(listener.address)
    owner.close()
    connected[0].close()
