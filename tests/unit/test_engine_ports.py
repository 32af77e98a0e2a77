"""Ports for vime's servers: chosen where outgoing connections do not take them, and an engine or the router whose
port was taken between choosing and binding it relaunches on a new one instead of failing the run (seen in CI: a
connection elsewhere on the node took the port during the engine's ~10 s start-up, and the router's). The engine stands in for vLLM
with a small HTTP server that binds like vLLM's (no SO_REUSEPORT) and prints the same error; this tests the code
around it."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
from types import SimpleNamespace

from vime.utils.auth import RunToken
from vime.utils.misc import find_free_port

SERVER = textwrap.dedent('''
    import http.server, sys
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *a):
            pass
    try:
        server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    except OSError as e:
        print("OSError:", e, flush=True)  # vLLM's launcher: "[Errno 98] Address already in use"
        sys.exit(1)
    server.serve_forever()
''')


def test_ports_are_chosen_below_the_ephemeral_range():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {find_free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports), ports
    assert len(ports) > 10  # random, so two runs starting together do not pick the same one


def test_an_engine_whose_port_is_taken_relaunches_on_a_new_one(tmp_path, monkeypatch):
    from vime.engine.control import engine

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)  # held by this process, as a connection or another server would hold it
    chosen = [taken.getsockname()[1], find_free_port()]
    ports = iter(chosen)
    (tmp_path / "server.py").write_text(SERVER)
    monkeypatch.setattr(engine, "find_free_port", lambda *a: next(ports))
    monkeypatch.setattr(engine, "engine_command", lambda args, host, port, rank: [sys.executable,
                                                                                  str(tmp_path / "server.py"), str(port)])
    monkeypatch.setattr(engine, "engine_env", lambda *a: dict(os.environ))
    monkeypatch.setattr(engine, "control_routes_locked", lambda url, token: None)  # the stand-in has no vime plugin
    monkeypatch.setattr("vime.utils.device.serving_host", lambda a: "127.0.0.1")
    args = SimpleNamespace(engine_startup_timeout=30, vllm_host=None, rollout_external_engine_addrs=None)
    e = engine.VLLMEngine(args, 0, str(tmp_path), RunToken.new())
    try:
        assert e.start() == f"http://127.0.0.1:{chosen[1]}"
        log = (tmp_path / "engine_0.log").read_text()
        assert log.count("Address already in use") == 1, log
    finally:
        e.stop()
        taken.close()


def test_an_engine_that_fails_for_another_reason_is_not_relaunched(tmp_path, monkeypatch):
    from vime.engine.control import engine

    launches = []
    monkeypatch.setattr(engine, "find_free_port", lambda *a: launches.append(1) or 1)
    monkeypatch.setattr(engine, "engine_command", lambda *a: [sys.executable, "-c", "raise SystemExit('bad model')"])
    monkeypatch.setattr(engine, "engine_env", lambda *a: dict(os.environ))
    monkeypatch.setattr("vime.utils.device.serving_host", lambda a: "127.0.0.1")
    args = SimpleNamespace(engine_startup_timeout=30, vllm_host=None, rollout_external_engine_addrs=None)
    e = engine.VLLMEngine(args, 0, str(tmp_path), RunToken.new())
    try:
        e.start()
        raise AssertionError("start() returned")
    except RuntimeError as err:
        assert "exited with code 1" in str(err) and "bad model" in str(err)
    assert len(launches) == 1


def test_the_router_whose_port_is_taken_relaunches_on_a_new_one(tmp_path):
    """The real vllm-router, its port held by a bound socket that is not listening, as an outgoing connection
    holds its port (seen in CI: "Error starting router: Address already in use"). With `relaunch_args` it starts
    again on the next port; without them (a port the user gave) it fails, and the error carries the router's log."""
    import pytest

    from vime.arguments import build_parser
    from vime.engine.control.arguments import router_args_from
    from vime.engine.control.router import Router, router_ok

    flags = build_parser().parse_args(["--hf-checkpoint", "x"])
    token = RunToken.new()
    taken = socket.socket()  # no SO_REUSEADDR, not listening: what a connection's local port looks like
    taken.bind(("127.0.0.1", find_free_port()))
    held, fresh = taken.getsockname()[1], find_free_port()
    on = lambda port: router_args_from(flags, "127.0.0.1", port, [], api_key=token.serving_key())  # noqa: E731
    relaunches = []
    router = Router(on(held), str(tmp_path / "a"), token, relaunch_args=lambda: relaunches.append(1) or on(fresh))
    fixed = Router(on(held), str(tmp_path / "b"), token)
    try:
        assert router.start(timeout_s=60) == f"http://127.0.0.1:{fresh}" and relaunches == [1]
        assert router_ok(token, router.url)
        assert "Address already in use" in (tmp_path / "a" / "router.log").read_text()
        with pytest.raises(RuntimeError, match=f"did not start on http://127.0.0.1:{held}(.|\n)*Address already in use"):
            fixed.start(timeout_s=60)
        assert fixed.proc is None
    finally:
        router.stop()
        fixed.stop()
        taken.close()
