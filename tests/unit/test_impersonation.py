"""Another user on the node binds the port vime chose for an engine or the router before vime's child does, and
answers /health: vime refuses to start, naming the port, and the impostor never sees the control token or the
serving key (it logs every request's Authorization header). The impostor runs as uid 65534 (`setpriv`), as a
second user would; the engine stands in for vLLM with a process that never binds (this tests the code around it);
the router is the real vllm-router, which cannot bind the held port."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from vime.utils.listeners import foreign_listener, listeners

pytestmark = pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to run the impostor as another user")

IMPOSTOR = textwrap.dedent('''
    import http.server, json, sys
    log = open(sys.argv[2], "a", buffering=1)
    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            log.write(json.dumps({"method": self.command, "path": self.path,
                                  "authorization": self.headers.get("Authorization")}) + "\\n")
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
        do_GET = do_POST = answer
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
''')


@pytest.fixture()
def impostor():
    """(port, requests it received): a server of uid 65534 holding a free loopback port."""
    import tempfile
    from pathlib import Path

    home = Path(tempfile.mkdtemp(prefix="vime-impostor-", dir="/tmp"))  # pytest's tmp_path is closed to others
    os.chmod(home, 0o755)
    script, log = home / "impostor.py", home / "requests.jsonl"
    script.write_text(IMPOSTOR)
    log.touch()
    os.chmod(log, 0o666)
    os.chmod(script, 0o644)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # started by a shell that exits at once: like another user's server, it is no process of ours
    pid_file = home / "pid"
    subprocess.run(["sh", "-c", f"setpriv --reuid=65534 --regid=65534 --clear-groups {sys.executable} -I {script} "
                                f"{port} {log} & echo $! > {pid_file}"], check=True)
    deadline = time.monotonic() + 30
    while not listeners(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(listeners(port).values()) == [65534]

    def received():
        return [json.loads(line) for line in log.read_text().splitlines()]

    yield port, received
    os.kill(int(pid_file.read_text()), 9)
    shutil.rmtree(home)


def test_foreign_listener_names_the_holder(impostor):
    port, _ = impostor
    assert foreign_listener(port, os.getpid()) == f"port {port} is held by a process that vime did not start (uid 65534)"
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen(1)
        assert foreign_listener(mine.getsockname()[1], os.getpid()) is None  # ours
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        unused = closed.getsockname()[1]
    assert foreign_listener(unused, os.getpid()) == f"nothing listens on port {unused}"


def test_engine_start_sends_no_token_to_an_impostor(impostor, tmp_path, monkeypatch):
    from vime.engine.control import engine
    from vime.utils.auth import RunToken

    port, received = impostor
    monkeypatch.setattr(engine, "find_free_port", lambda *a: port)
    # the real engine would fail to bind the held port; a process that never binds stands in for it
    monkeypatch.setattr(engine, "engine_command", lambda *a: [sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(engine, "engine_env", lambda *a: dict(os.environ))
    args = SimpleNamespace(engine_startup_timeout=30, vllm_host=None, rollout_external_engine_addrs=None)
    monkeypatch.setattr("vime.utils.device.serving_host", lambda a: "127.0.0.1")
    e = engine.VLLMEngine(args, 0, str(tmp_path), RunToken("t" * 64))
    with pytest.raises(RuntimeError, match=f"port {port} is held by a process that vime did not start"):
        e.start()
    assert e.proc is None  # its own process was stopped
    assert received() and all(r["authorization"] is None for r in received()), received()
    assert {r["path"] for r in received()} == {"/health"}


def test_router_start_sends_nothing_to_an_impostor(impostor, tmp_path):
    from vime.arguments import build_parser
    from vime.engine.control.arguments import router_args_from
    from vime.engine.control.router import Router
    from vime.utils.auth import RunToken

    port, received = impostor
    flags = build_parser().parse_args(["--hf-checkpoint", "x"])
    token = RunToken.new()
    router = Router(router_args_from(flags, "127.0.0.1", port, [], api_key=token.serving_key()), str(tmp_path),
                    token)
    with pytest.raises(RuntimeError, match=str(port)):
        router.start(timeout_s=30)
    assert router.proc is None
    assert all(r["authorization"] is None and r["method"] == "GET" for r in received()), received()


HOSTILE = textwrap.dedent('''
    import json, sys, urllib.error, urllib.request
    router, theirs, ours = sys.argv[1:4]
    routes = [("POST", "/add_worker?url=" + theirs), ("POST", "/remove_worker?url=" + ours), ("POST", "/flush_cache"),
              ("GET", "/workers"), ("GET", "/list_workers"), ("GET", "/health"), ("GET", "/get_server_info")]
    seen = {}
    for method, route in routes:
        for key in (None, "0" * 64):
            request = urllib.request.Request(router + route, method=method, data=b"" if method == "POST" else None)
            if key:
                request.add_header("Authorization", "Bearer " + key)
            try:
                with urllib.request.urlopen(request, timeout=10) as r:
                    seen[f"{method} {route} {bool(key)}"] = r.status
            except urllib.error.HTTPError as e:
                seen[f"{method} {route} {bool(key)}"] = e.code
    print(json.dumps(seen))
''')


def test_another_user_cannot_steer_the_router_and_a_stranger_worker_is_removed(tmp_path):
    """Another user (uid 65534) calls vime's real router: every route, /add_worker and /remove_worker included,
    answers 401 without the run's serving key (`router_door`), and the router still serves vime's engine alone.
    A stranger in its worker list all the same (added by a holder of the key, or by an older router) is removed at
    the next rollout's check and reported."""
    from vime.arguments import build_parser
    from vime.engine.control.arguments import router_args_from
    from vime.engine.control.router import Router, post_worker
    from vime.rollout_manager.engine_fleet import EngineFleet
    from vime.rollout.context import reset_rollout_context

    (tmp_path / "worker.py").write_text(IMPOSTOR)  # a server that answers 200 (the router checks /health)
    ports = (_free_port(), _free_port())
    servers = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(port), str(tmp_path / "log")])
               for port in ports]
    ours, theirs = [f"http://127.0.0.1:{port}" for port in ports]
    for port in ports:
        deadline = time.monotonic() + 30
        while not listeners(port) and time.monotonic() < deadline:
            time.sleep(0.05)
    flags = build_parser().parse_args(["--hf-checkpoint", "x"])
    context = reset_rollout_context()  # the manager's: where the fleet counts, holding the run's token
    token = context.token
    router = Router(router_args_from(flags, "127.0.0.1", _free_port(), [], api_key=token.serving_key()),
                    str(tmp_path), token)
    fleet = EngineFleet(SimpleNamespace(control_token_file=None, debug_train_only=True), None, tmp_path, context)
    try:
        fleet.router, fleet.router_url = router, router.start()
        fleet.engine_urls = [ours]
        router.add_worker(ours)
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-I",
                               "-c", HOSTILE, fleet.router_url, theirs, ours],
                              capture_output=True, text=True, check=True, timeout=60)
        seen = json.loads(proc.stdout)
        assert len(seen) == 14 and set(seen.values()) == {401}, seen
        assert router.workers() == [ours]  # nothing they sent changed it
        post_worker(token, fleet.router_url, "add_worker", theirs)
        assert sorted(router.workers()) == sorted([ours, theirs])
        assert fleet.recovery.reconcile_router() == [theirs]
        assert router.workers() == [ours]
        assert context.counters["rollout/router_unknown_workers_removed"] == 1
        assert fleet.recovery.reconcile_router() == []  # nothing more to do
    finally:
        router.stop()
        for s in servers:
            s.kill()
            s.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
