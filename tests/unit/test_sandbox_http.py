"""The sandbox service: HTTPSandbox against sandbox_app; a bearer token is required, and the service's own
maximum limits hold whatever a client asks for."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from vime.agents.sandbox import HTTPSandbox, LocalSandbox, SandboxLimits, SandboxRefused, make_sandbox, sandbox_app
from vime.agents.sandbox.service import authorized

pytestmark = pytest.mark.skipif(not os.path.exists("/proc"), reason="LocalSandbox needs Linux")
TOKEN = "test-token-" + "x" * 32


@pytest.fixture(scope="module")
def service():
    """A sandbox service on a free port of this machine (its own thread and event loop): yields its URL."""
    from aiohttp import web

    ready, holder = threading.Event(), {}

    def serve():
        loop = asyncio.new_event_loop()
        app = sandbox_app(LocalSandbox(), token=TOKEN, max_limits=SandboxLimits(wall_time_s=1, memory_mb=512))
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["port"], holder["loop"] = site._server.sockets[0].getsockname()[1], loop
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{holder['port']}"
    holder["loop"].call_soon_threadsafe(holder["loop"].stop)
    thread.join(10)


def _post(url: str, body: dict, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/run", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an http_proxy
    try:
        with opener.open(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_runs_with_the_token(service, monkeypatch):
    monkeypatch.setenv("VIME_SANDBOX_TOKEN", TOKEN)
    remote = make_sandbox(service)
    assert isinstance(remote, HTTPSandbox)
    r = asyncio.run(remote.run(code="print(open('f.txt').read() * 2)", files={"f.txt": "ab"}))
    assert r.ok and r.stdout == "abab\n"


def test_requests_without_the_right_token_are_refused(service):
    body = {"code": "print(1)"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                    {"Authorization": f"Bearer {TOKEN}x"}):
        status, answer = _post(service, body, headers)
        assert status == 401 and "token" in answer["error"], headers
    assert _post(service, body, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    with pytest.raises(RuntimeError, match="HTTP 401"):
        asyncio.run(HTTPSandbox(service, token="wrong").run(code="print(1)"))


def test_limits_are_clamped_to_the_service_maximum(service):
    remote = HTTPSandbox(service, token=TOKEN)
    start = time.monotonic()
    r = asyncio.run(remote.run(code="while True: pass", limits=SandboxLimits(wall_time_s=60)))
    assert r.stopped_reason == "timeout" and time.monotonic() - start < 8  # the service's 1 s, not 60
    r = asyncio.run(remote.run(code="x = bytearray(700 * 2**20)", limits=SandboxLimits(memory_mb=4096)))
    assert r.stopped_reason == "memory", r  # the service's 512 MiB
    with pytest.raises(SandboxRefused, match="does not allow network"):
        asyncio.run(remote.run(code="print(1)", limits=SandboxLimits(allow_network=True)))
    status, answer = _post(service, {"code": "1", "limits": {"wall_time_s": -5}}, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 400 and "positive" in answer["error"]


def test_both_sides_need_a_token(monkeypatch):
    monkeypatch.delenv("VIME_SANDBOX_TOKEN", raising=False)
    with pytest.raises(ValueError, match="needs the sandbox service's token"):
        sandbox_app(LocalSandbox())
    with pytest.raises(ValueError, match="VIME_SANDBOX_TOKEN"):
        HTTPSandbox("http://127.0.0.1:1")


def test_clamp_and_authorization_rules():
    cap = SandboxLimits(wall_time_s=2, memory_mb=256, max_processes=4)
    asked = SandboxLimits(wall_time_s=30, cpu_time_s=100, memory_mb=128, max_processes=64)
    got = asked.clamped_to(cap)
    assert (got.wall_time_s, got.cpu_time_s, got.memory_mb, got.max_processes) == (2, 2, 128, 4)
    assert SandboxLimits(wall_time_s=1).clamped_to(SandboxLimits(wall_time_s=5)).cpu_time_s == 1
    assert authorized(f"Bearer {TOKEN}", TOKEN) and not authorized(None, TOKEN) and not authorized("Bearer ", TOKEN)


@pytest.mark.parametrize("options, address", [([], "127.0.0.1"), (["--host", "0.0.0.0"], "0.0.0.0")])
def test_the_service_listens_on_this_machine_only_unless_exposed(options, address):
    """`python -m vime.agents.sandbox` runs code for whoever holds the token: it listens on loopback unless
    --host names the address to expose it on."""
    from vime.utils.listeners import hex_address, tcp_sockets
    from vime.utils.misc import find_free_port

    port = find_free_port()
    env = {**os.environ, "VIME_SANDBOX_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "vime.agents.sandbox", "--port", str(port), *options], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, bound = time.monotonic() + 60, set()
        while not bound and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            bound = {local for local, _, state, _, _ in tcp_sockets()
                     if state == "0A" and local.endswith(f":{port:04X}")}  # 0A: listening
        assert bound == {hex_address(address, port)}, proc.stderr.read().decode() if proc.poll() is not None else ""
    finally:
        proc.terminate()
        proc.wait(30)
