"""The plugin view (`vime.utils.plugin_args`) and the router's front for plugins (`router_gate`): the view adds
the run-time values under vime's and slime's names without touching the flags, and travels to a training rank as
plain values; the gate forwards this user's GET and generation requests with the serving key, refuses the router's
control routes, and refuses another user (a real second uid) outright."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from vime.engine.control.router_gate import RouterGate, forwarded, peer_uid
from vime.utils.plugin_args import plugin_view, plugin_view_from, runtime_values


def _flags(**over) -> argparse.Namespace:
    return argparse.Namespace(**{"rollout_concurrency": 100, "vllm_router_ip": None, "vllm_router_port": None,
                                 "num_rollout": None, "lr": 1e-3, **over})


def test_view_adds_run_values_under_both_names_and_leaves_the_flags():
    flags = _flags()
    view = plugin_view(flags, "http://127.0.0.1:4321", num_rollout=7, num_engines=3)
    assert (view.vllm_router_ip, view.vllm_router_port) == ("127.0.0.1", 4321)
    assert (view.sglang_router_ip, view.sglang_router_port) == ("127.0.0.1", 4321)
    assert view.num_rollout == 7 and view.rollout_num_engines == 3 and view.lr == 1e-3
    # slime's per-engine limit times the engines covers vime's limit over all engines
    assert view.sglang_server_concurrency == 34 and view.sglang_server_concurrency * 3 >= flags.rollout_concurrency
    assert flags.vllm_router_ip is None and flags.num_rollout is None and not hasattr(flags, "sglang_router_ip")
    no_engines = plugin_view(flags, None, num_rollout=None, num_engines=0)
    assert no_engines.vllm_router_ip is None and no_engines.sglang_router_port is None


def test_view_travels_as_plain_values():
    view = plugin_view(_flags(), "http://127.0.0.1:4321", num_rollout=7, num_engines=2)
    values = json.loads(json.dumps(runtime_values(view)))  # what reaches a training rank over Ray
    rank_flags = _flags(num_layers=2)  # a rank's own flags carry the model's architecture too
    rank_view = plugin_view_from(rank_flags, values)
    assert (rank_view.vllm_router_port, rank_view.num_rollout, rank_view.num_layers) == (4321, 7, 2)
    assert rank_flags.vllm_router_port is None
    with pytest.raises(ValueError, match="lr"):  # only run-time fields may differ from the flags
        plugin_view_from(rank_flags, {**values, "lr": 1.0})


def test_forwarded_routes():
    assert forwarded("GET", "/workers") and forwarded("GET", "/list_workers")
    assert forwarded("POST", "/inference/v1/generate") and forwarded("POST", "/v1/chat/completions")
    for path in ("/add_worker", "/remove_worker", "/flush_cache"):
        assert not forwarded("POST", path)


@pytest.fixture()
def upstream():
    """A stand-in router: answers every request with what it received (method, path, Authorization, body);
    /stream answers in three chunks."""
    from aiohttp import web

    from vime.utils.async_utils import get_loop, run

    async def echo(request):
        if request.path == "/stream":
            response = web.StreamResponse()
            await response.prepare(request)
            for part in (b"a", b"b", b"c"):
                await response.write(part)
            await response.write_eof()
            return response
        return web.json_response({"method": request.method, "path": request.path_qs,
                                  "authorization": request.headers.get("Authorization"),
                                  "body": (await request.read()).decode()})

    async def start():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", echo)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    get_loop()
    runner, port = run(start())
    yield f"http://127.0.0.1:{port}"
    run(runner.cleanup())


def _get(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_gate_forwards_with_the_serving_key(upstream):
    current = {"url": upstream}
    gate = RouterGate(lambda: current["url"], lambda: {"Authorization": "Bearer serving-key"})
    gate.start()
    try:
        status, body = _get(gate.url + "/workers?x=1", headers={"Authorization": "Bearer theirs"})
        seen = json.loads(body)
        assert status == 200 and seen["path"] == "/workers?x=1" and seen["authorization"] == "Bearer serving-key"
        status, body = _get(gate.url + "/inference/v1/generate", "POST", b'{"token_ids": [1]}',
                            {"Content-Type": "application/json"})
        assert status == 200 and json.loads(body)["body"] == '{"token_ids": [1]}'
        assert _get(gate.url + "/stream") == (200, b"abc")
        status, body = _get(gate.url + "/add_worker?url=http://127.0.0.1:1", "POST", b"")
        assert status == 403 and b"fleet owns" in body
        current["url"] = None  # the router is restarting
        assert _get(gate.url + "/workers")[0] == 503
        assert gate.refused == 0
    finally:
        gate.stop()


def test_peer_uid_of_a_loopback_connection():
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    conn, peer = server.accept()
    try:
        assert peer_uid(peer, conn.getsockname()) == os.getuid()
        assert peer_uid(("127.0.0.1", 1), conn.getsockname()) is None
    finally:
        for s in (client, conn, server):
            s.close()


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv for a 2nd uid")
def test_gate_refuses_another_user(upstream):
    """A client running as uid 65534 (another user on the node) gets 403 and never reaches the router."""
    gate = RouterGate(lambda: upstream, lambda: {"Authorization": "Bearer serving-key"})
    gate.start()
    hostile = ("import sys, urllib.request, urllib.error\n"
               "try:\n    urllib.request.urlopen(sys.argv[1] + '/inference/v1/generate', data=b'{}', timeout=10)\n"
               "    print(200)\nexcept urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())\n")
    try:
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-I",
                               "-c", hostile, gate.url], capture_output=True, text=True, timeout=60)
        assert proc.stdout.startswith("403") and "serving-key" not in proc.stdout, (proc.stdout, proc.stderr)
        assert gate.refused == 1
    finally:
        gate.stop()


def test_gate_sync_client_from_many_threads(upstream):
    """Plugins call it from threads (sync rewards) as well as from the rollout loop: each request is answered."""
    gate = RouterGate(lambda: upstream, lambda: {"Authorization": "Bearer k"})
    gate.start()
    results = []
    try:
        threads = [threading.Thread(target=lambda: results.append(_get(gate.url + "/list_workers")[0]))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        gate.stop()
    assert results == [200] * 8


def _answer_to_headers(url: str, head: str, sent_body: bytes = b"", timeout_s: float = 10.0) -> bytes:
    """The status line the gate answers to a request of which only `head` (and `sent_body`) was sent."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=timeout_s) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + sent_body)
        return sock.recv(4096).split(b"\r\n", 1)[0]


def test_gate_refuses_a_body_over_its_cap_with_413(upstream):
    """Over `max_body_bytes`: refused before a byte of it is read when the Content-Length says so, and once the
    limit is passed when it is sent chunked."""
    gate = RouterGate(lambda: upstream, lambda: {"Authorization": "Bearer k"}, max_body_bytes=2**16)
    gate.start()
    try:
        head = "POST /inference/v1/generate HTTP/1.1\r\nHost: gate\r\nContent-Type: application/json"
        assert _answer_to_headers(gate.url, f"{head}\r\nContent-Length: {2**40}") == (
            b"HTTP/1.1 413 Request Entity Too Large")
        status, body = _get(gate.url + "/inference/v1/generate", "POST", iter([b" " * 2**15] * 4),
                            {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        assert status == 413 and f"limit of {2**16} bytes".encode() in body
        status, body = _get(gate.url + "/inference/v1/generate", "POST", b"x" * 2**16)  # at the limit: served
        assert status == 200 and len(json.loads(body)["body"]) == 2**16
    finally:
        gate.stop()
    assert RouterGate(lambda: upstream, lambda: {}).max_body_bytes == 64 * 2**20  # not the 1 GiB it was


def test_gate_answers_408_to_a_body_that_does_not_come(upstream):
    gate = RouterGate(lambda: upstream, lambda: {"Authorization": "Bearer k"}, body_timeout_s=0.5)
    gate.start()
    try:
        head = "POST /inference/v1/generate HTTP/1.1\r\nHost: gate\r\nContent-Length: 100"
        assert _answer_to_headers(gate.url, head, sent_body=b"{") == b"HTTP/1.1 408 Request Timeout"
    finally:
        gate.stop()
