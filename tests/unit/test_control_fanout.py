"""The control plane's fan-outs are bounded: control calls to the engines (`client.CONTROL_FANOUT`), the health
monitor's probes (`health.PROBE_FANOUT`, under the fleet's lock) and the router's worker registrations
(`router.REGISTER_FANOUT`); a collective weight update alone has every engine in flight at once, past httpx's
default pool of 100 connections. `bench/control_plane.py` measures them at 1,000 stand-in engines."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vime.engine.control import client, router
from vime.rollout_manager import engine_health as health
from vime.utils.auth import RunToken

TOKEN = RunToken.new()


class InFlight:
    """Counts calls in flight and the most seen at once."""

    def __init__(self):
        self.now = self.most = 0
        self._lock = threading.Lock()

    def __enter__(self):
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *exc):
        with self._lock:
            self.now -= 1


def serve(handle) -> ThreadingHTTPServer:
    """A local server whose every POST runs `handle()` and answers {}."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            handle()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 512  # every engine's connection may arrive at once

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def engine_urls(server, n: int) -> list[str]:
    """`n` distinct engine URLs on one server (a path prefix each)."""
    return [f"http://127.0.0.1:{server.server_address[1]}/engine{i}" for i in range(n)]


def test_control_calls_to_the_engines_are_bounded(monkeypatch):
    monkeypatch.setattr(client, "CONTROL_FANOUT", 4)
    in_flight = InFlight()

    def handle():
        with in_flight:
            time.sleep(0.02)

    server = serve(handle)
    try:
        answers, errors = client.post_each(TOKEN, engine_urls(server, 24), "/abort_requests", body={})
    finally:
        server.shutdown()
    assert len(answers) == 24 and not errors
    assert in_flight.most == 4


def test_a_collective_update_has_every_engine_in_flight_past_httpx_default_pool():
    receivers = 120  # above httpx's default cap of 100 connections per client
    collective = threading.Barrier(receivers, timeout=5)  # no receiver returns before all have joined
    server = serve(collective.wait)
    try:
        answers, errors = client.update_weights_each(TOKEN, engine_urls(server, receivers), {}, 1, all_at_once=True,
                                                     timeout=10)
    finally:
        server.shutdown()
    assert not errors and len(answers) == receivers


def test_health_probes_run_in_parallel_bounded_and_under_the_sweep_lock(monkeypatch):
    monkeypatch.setattr(health, "PROBE_FANOUT", 8)
    lock, in_flight, outside_lock = threading.Lock(), InFlight(), []

    def probe(rank):
        if not lock.locked():
            outside_lock.append(rank)
        with in_flight:
            time.sleep(0.02)
        return "dead" if rank == 5 else None

    restarted = []
    monitor = health.EngineHealthMonitor(64, probe, lambda rank, why: restarted.append((rank, why)), interval_s=60,
                                         sweep_lock=lock)
    start = time.monotonic()
    assert monitor.check_once() == [5] and restarted == [(5, "dead")]
    assert in_flight.most == 8 and not outside_lock
    assert time.monotonic() - start < 64 * 0.02 / 2  # not one probe after another
    assert not lock.locked()  # released before the restarts and after the sweep


def test_router_registrations_are_bounded(monkeypatch):
    monkeypatch.setattr(router, "REGISTER_FANOUT", 3)
    in_flight, added = InFlight(), []

    def post_worker(token, router_url, route, url):
        with in_flight:
            time.sleep(0.01)
            added.append((route, url))

    monkeypatch.setattr(router, "post_worker", post_worker)
    router.post_workers(TOKEN, "http://router", "add_worker", [f"http://e{i}" for i in range(12)])
    assert sorted(added) == sorted(("add_worker", f"http://e{i}") for i in range(12))
    assert in_flight.most == 3


def test_a_failed_registration_raises(monkeypatch):
    def post_worker(token, router_url, route, url):
        if url == "http://bad":
            raise OSError("refused")

    monkeypatch.setattr(router, "post_worker", post_worker)
    with pytest.raises(OSError, match="refused"):
        router.post_workers(TOKEN, "http://router", "add_worker", ["http://ok", "http://bad"])
