"""The router's door: only callers holding the run's serving key get through, on every route.

vllm-router 0.1.17 has no key of its own for callers, but given `api_key_validation_urls` it asks a URL about
each caller it has not seen: a GET carrying the caller's `Authorization` header, where a 200 answer admits the
caller (the answer is remembered per header) and anything else, or no answer, refuses it with 401. It does so on
every route: generation, and the admin routes another user of the node would otherwise use to steer the run
(`/add_worker`, `/remove_worker`, `/flush_cache`, `/workers`, `/health`).

`open_door` serves that URL from the router's own process (`router.py` calls it before the router starts): the
socket is bound and listening first and this process holds it until it ends, so no other process can take the
port and answer in its place while the router runs (an impostor there would read the key the router forwards).
The answers come from a forked child, since the router's `start()` holds the GIL; the child dies with the router,
and if it died first the router would find nobody answering and refuse everyone. Any user of the node can connect
to it, so a connection that sends nothing for DOOR_TIMEOUT_S is dropped, and beyond DOOR_MAX_THREADS connections
at once the next are answered 503 (refused) at once rather than each given a thread.
"""

from __future__ import annotations

import ctypes
import http.server
import os
import signal
import socket
import threading

from vime.utils.auth import bearer_matches

_PR_SET_PDEATHSIG = 1
DOOR_TIMEOUT_S = 10.0  # a key check is one short GET from the router, on loopback
DOOR_MAX_THREADS = 64  # the router checks each caller once (the answer is remembered)
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def open_door(keys: tuple[str, ...]) -> tuple[str, socket.socket]:
    """Start answering the router's key checks: 200 for `Authorization: Bearer <key>` with one of `keys`, 401
    otherwise. Returns the URL to give the router as `api_key_validation_urls` and the listening socket, which the
    caller keeps open for as long as the router runs. Call before any thread starts."""
    if not keys or not all(keys):
        raise ValueError("the router's door needs at least one non-empty key")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    parent = os.getpid()
    if os.fork() == 0:
        try:
            _die_with(parent)
            _serve(sock, tuple(keys))
        finally:
            os._exit(0)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/validate", sock


def _die_with(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the router ended before the line above
        os._exit(0)


def _serve(sock: socket.socket, keys: tuple[str, ...]) -> None:
    door_server(sock, keys).serve_forever()


def door_server(sock: socket.socket, keys: tuple[str, ...], timeout_s: float = DOOR_TIMEOUT_S,
                max_threads: int = DOOR_MAX_THREADS) -> http.server.ThreadingHTTPServer:
    """The key-check server on the listening `sock` (not serving yet: `serve_forever()`)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = timeout_s  # on every read and write of the connection (StreamRequestHandler.setup)

        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if bearer_matches(self.headers.get("Authorization"), keys) else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):  # a line per caller in the router's log would be noise
            pass

    server = _BoundedServer(sock.getsockname(), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.slots = threading.BoundedSemaphore(max_threads)
    return server


class _BoundedServer(http.server.ThreadingHTTPServer):
    """A thread per connection, `slots` of them at once; a connection beyond is answered 503 and closed."""

    daemon_threads = True
    slots: threading.BoundedSemaphore

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            _refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _refuse(request: socket.socket) -> None:
    try:
        request.settimeout(1.0)  # the accepting thread must not wait on a caller that reads nothing
        request.sendall(_BUSY)
    except OSError:
        pass
