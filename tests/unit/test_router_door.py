"""The router's door (`router_door`), which any user of the node can connect to: a connection that sends nothing
is dropped after the door's timeout, and connections beyond its thread bound are answered 503 at once, while the
router's key checks (200 with the key, 401 without) go on being answered. The door's server runs in a thread here
(in a run it is the forked child's whole job)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from vime.engine.control.router_door import door_server


@pytest.fixture
def door():
    """Opens a door for the key "k" with the given door_server options; returns its address."""
    opened = []

    def open_door(**options):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        server = door_server(sock, ("k",), **options)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        opened.append((server, thread, sock))
        return sock.getsockname()

    yield open_door
    for server, thread, sock in opened:
        server.shutdown()
        thread.join(10)
        sock.close()


def _check(address, key: str | None) -> bytes:
    """The status line the door answers a key check with."""
    with socket.create_connection(address, timeout=10) as sock:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        sock.sendall(f"GET /validate HTTP/1.1\r\nHost: door\r\n{auth}\r\n".encode())
        return sock.recv(4096).split(b"\r\n", 1)[0]


def test_a_connection_that_sends_nothing_is_dropped(door):
    address = door(timeout_s=0.5)
    with socket.create_connection(address, timeout=10) as silent:
        start = time.monotonic()
        assert silent.recv(4096) == b""  # closed by the door, not by this side's 10 s timeout
        assert time.monotonic() - start < 5
    assert _check(address, "k") == b"HTTP/1.0 200 OK"
    assert _check(address, "guess") == b"HTTP/1.0 401 Unauthorized"


def test_connections_beyond_the_thread_bound_are_refused_at_once(door):
    address = door(timeout_s=30, max_threads=2)
    held = [socket.create_connection(address, timeout=10) for _ in range(2)]  # a thread each, waiting on them
    try:
        start = time.monotonic()
        assert _check(address, "k") == b"HTTP/1.0 503 Service Unavailable"  # accepted after the two: no slot
        assert time.monotonic() - start < 5
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while _check(address, "k") != b"HTTP/1.0 200 OK":  # the held connections' threads end on their close
        assert time.monotonic() < deadline, "the door did not free its threads"
        time.sleep(0.05)
