"""The run's control token and serving key (`vime.utils.auth`), the engine routes each opens (`route_auth`), and
the clients that send them. The real engines and router are checked in tests/e2e/test_engine_fault_tolerance_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from vime.engine.in_vllm.route_auth import RunTokenMiddleware, accepted_keys
from vime.utils import auth

TOKEN = "t" * 64


def test_a_run_token_carries_its_keys_and_hides_its_secret():
    token = auth.RunToken(TOKEN)
    assert token.control_headers() == {"Authorization": f"Bearer {TOKEN}"}
    assert token.serving_key() == auth.serving_key(TOKEN)
    assert token.serving_headers() == {"Authorization": f"Bearer {auth.serving_key(TOKEN)}"}
    for shown in (repr(token), str(token), f"{token}", repr(SimpleNamespace(token=token))):
        assert TOKEN not in shown and token.serving_key() not in shown, shown
    fresh = {auth.RunToken.new().control for _ in range(4)}
    assert len(fresh) == 4 and all(len(t) == 64 and set(t) <= set("0123456789abcdef") for t in fresh)  # 256 bits
    with pytest.raises(ValueError, match="empty"):
        auth.RunToken("")
    with pytest.raises(AttributeError):  # immutable: a holder hands it on, nobody changes it
        token.control = "x" * 64


def test_each_route_opens_with_its_keys():
    serve = auth.serving_key(TOKEN)
    assert serve != TOKEN and serve == auth.serving_key(TOKEN) and len(serve) == 64
    assert accepted_keys("/health", TOKEN, serve) == ()
    for path in ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"):
        assert accepted_keys(path, TOKEN, serve) == (TOKEN, serve), path
    for path in ("/collective_rpc", "/vime/update_weights", "/pause", "/sleep", "/metrics", "/docs", "/",
                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/healthz", "/health/../pause",
                 # a prefix once opened these to the serving key: vLLM's abort route, and any route a later vLLM adds
                 "/inference/v1/abort_requests", "/v1/responses/abc/cancel", "/v1/some_new_admin_route",
                 "/v2/unknown", "/tokenize/../pause"):
        assert accepted_keys(path, TOKEN, serve) == (TOKEN,), path


def test_bearer_matches_only_the_whole_key():
    assert auth.bearer_matches(f"Bearer {TOKEN}", (TOKEN,))
    assert auth.bearer_matches(f"bearer {TOKEN}", ("other", TOKEN))
    for header in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", "Bearer "):
        assert not auth.bearer_matches(header, (TOKEN,)), header


def test_the_middleware_answers_401_before_the_route_runs():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    ran = []

    async def handler(request):
        ran.append(request.url.path)
        return PlainTextResponse("ok")

    routes = [Route(p, handler, methods=["GET", "POST"]) for p in ("/health", "/collective_rpc", "/v1/completions")]
    app = Starlette(routes=routes)
    app.add_middleware(RunTokenMiddleware, control_token=TOKEN, serving_key=auth.serving_key(TOKEN))
    client = TestClient(app)
    control, serve = {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": f"Bearer {auth.serving_key(TOKEN)}"}
    assert client.get("/health").status_code == 200
    assert [client.post("/collective_rpc", headers=h).status_code for h in ({}, serve, control)] == [401, 401, 200]
    assert [client.post("/v1/completions", headers=h).status_code for h in ({}, serve, control)] == [401, 200, 200]
    refused = client.post("/collective_rpc")
    assert refused.headers["www-authenticate"] == "Bearer" and "token" in refused.json()["error"]
    assert ran == ["/health", "/collective_rpc", "/v1/completions", "/v1/completions"]


def test_token_file_must_be_private_and_long(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        auth.read_token_file(str(path))
    path.chmod(0o600)
    assert auth.read_token_file(str(path)) == TOKEN
    assert auth.RunToken.read(str(path)) == auth.RunToken(TOKEN)
    path.write_text("short")
    with pytest.raises(ValueError, match="at least 32"):
        auth.read_token_file(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        auth.read_token_file(str(tmp_path / "missing"))


def test_the_token_reaches_the_engine_server_and_no_other_child(monkeypatch, tmp_path):
    from vime.engine.control.arguments import router_args_from
    from vime.engine.control.engine import engine_env

    token = auth.RunToken(TOKEN)
    args = SimpleNamespace(rollout_num_gpus_per_engine=1, cpu_kv_cache_space=1)
    monkeypatch.setenv(auth.CONTROL_TOKEN_ENV, "a token the user's shell exported")
    env = engine_env(args, tmp_path / "token")
    assert env[auth.CONTROL_TOKEN_FILE_ENV] == str(tmp_path / "token")  # the server's environment names the file
    assert auth.CONTROL_TOKEN_ENV not in env and not any(TOKEN in value for value in env.values())
    monkeypatch.delenv(auth.CONTROL_TOKEN_ENV)
    for name in (auth.CONTROL_TOKEN_ENV, auth.CONTROL_TOKEN_FILE_ENV):  # a reward server or sandbox this process
        assert name not in os.environ  # starts never gets it
    from vime.arguments import parse_args

    parsed = parse_args(["--hf-checkpoint", "x"], validate=False)
    assert not hasattr(parsed, "router_api_key")  # vime gives the router its key; a flag for it would be ignored
    assert router_args_from(parsed, "127.0.0.1", 1, [], api_key=token.serving_key()).api_key == token.serving_key()


def test_a_server_reads_its_token_from_a_private_file(monkeypatch, tmp_path):
    """`write_token_file` makes a 600 file in a fresh 700 directory; a server reads it (`token_from_environment`),
    and refuses to start unguarded from a file it cannot read safely; the variable holding the token itself is for
    engines a user starts by hand."""
    path = auth.write_token_file(auth.RunToken(TOKEN))
    try:
        assert path.read_text() == TOKEN
        assert oct(path.stat().st_mode & 0o777) == oct(0o600) and oct(path.parent.stat().st_mode & 0o777) == oct(0o700)
        monkeypatch.setenv(auth.CONTROL_TOKEN_FILE_ENV, str(path))
        monkeypatch.setenv(auth.CONTROL_TOKEN_ENV, "f" * 64)  # the file wins
        assert auth.token_from_environment() == TOKEN
        path.chmod(0o640)
        with pytest.raises(ValueError, match=f"{auth.CONTROL_TOKEN_FILE_ENV} {path}: readable by other users"):
            auth.token_from_environment()
    finally:
        auth.remove_token_file(path)
    assert not path.parent.exists()
    auth.remove_token_file(path)  # twice: nothing to do
    with pytest.raises(ValueError, match="cannot read it"):
        auth.token_from_environment()
    monkeypatch.delenv(auth.CONTROL_TOKEN_FILE_ENV)
    assert auth.token_from_environment() == "f" * 64
    monkeypatch.delenv(auth.CONTROL_TOKEN_ENV)
    assert auth.token_from_environment() is None


STAND_IN_ENGINE = """
import sys, uvicorn
from fastapi import FastAPI
from vime.engine.in_vllm.endpoint_plugin import require_run_token
app = FastAPI()
app.get("/health")(lambda: {})
app.get("/is_paused")(lambda: {"is_paused": False})
require_run_token(app)  # what vime's plugin does in a vLLM server
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_an_engine_server_holds_the_token_in_no_environment(monkeypatch, tmp_path):
    """The server of an engine vime starts gets the token from a file, guards its routes with it (`start` checks),
    and neither it nor anything it starts has the token in /proc/<pid>/environ, which any process of this user may
    read (a sandboxed program without Landlock included). The file is gone once the engine serves. The server
    stands in for vLLM: the real `engine_env`, the real plugin function, a small FastAPI app."""
    from vime.engine.control import engine
    from vime.utils.listeners import process_tree

    (tmp_path / "server.py").write_text(STAND_IN_ENGINE)
    server = [sys.executable, str(tmp_path / "server.py")]
    monkeypatch.setattr(engine, "engine_command", lambda args, host, port, rank: [*server, str(port)])
    monkeypatch.setattr("vime.utils.device.serving_host", lambda a: "127.0.0.1")
    args = SimpleNamespace(engine_startup_timeout=60, vllm_host=None, rollout_external_engine_addrs=None,
                           rollout_num_gpus_per_engine=1, cpu_kv_cache_space=1)
    e = engine.VLLMEngine(args, 0, str(tmp_path), auth.RunToken(TOKEN))
    try:
        e.start()  # refuses an engine whose routes open without the token
        environments = {}
        for pid in process_tree(e.pid()):
            with open(f"/proc/{pid}/environ", "rb") as environ, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                environments[pid] = environ.read()
                assert TOKEN.encode() not in environments[pid] + cmdline.read(), pid
        named = {v.split(b"=", 1)[1] for env in environments.values() for v in env.split(b"\0")
                 if v.startswith(auth.CONTROL_TOKEN_FILE_ENV.encode() + b"=")}
        assert len(named) == 1 and not os.path.exists(named.pop())  # read by the server, then removed
    finally:
        e.stop()


class _Recorder(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.seen.append((self.path, self.headers.get("Authorization")))
        body = json.dumps({"choices": [{"index": 0, "token_ids": [1]}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_clients_send_the_control_token_and_the_serving_key():
    """Each call carries the token its caller passed: two runs in one process each send their own."""
    import aiohttp

    from vime.engine.control import client
    from vime.engine.control.generate_request import request_generate

    token, other = auth.RunToken(TOKEN), auth.RunToken("o" * 64)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for run in (token, other):
            client.reset_prefix_cache(run, [url])

            async def generate():
                async with aiohttp.ClientSession() as http:
                    await request_generate(http, url, {"token_ids": [1]}, token=run,
                                           timeout=aiohttp.ClientTimeout(total=10), retries=0)

            asyncio.run(generate())
    finally:
        server.shutdown()
    assert _Recorder.seen == [("/reset_prefix_cache", f"Bearer {TOKEN}"),
                              ("/inference/v1/generate", f"Bearer {auth.serving_key(TOKEN)}"),
                              ("/reset_prefix_cache", f"Bearer {'o' * 64}"),
                              ("/inference/v1/generate", f"Bearer {auth.serving_key('o' * 64)}")]
