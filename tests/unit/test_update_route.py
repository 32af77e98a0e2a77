"""The one-call weight update: the endpoint's request checks, the VLLM_PLUGINS allowlist, and the client's
fallback to separate control calls for an engine without vime's route.

The fallback is exercised against a local HTTP stand-in that records the routes it is asked for (no engine: this
tests the client's protocol only). The route on a real vLLM engine is tested in test_weight_transport.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest

from vime.engine.control import client
from vime.engine.control.engine import plugin_allowlist
from vime.engine.in_vllm.endpoint_plugin import _parse
from vime.engine.protocol.names import UPDATE_ROUTE as ROUTE
from vime.utils.auth import RunToken

TOKEN = RunToken.new()


def test_parse_names_what_is_wrong():
    assert _parse({"method": "reload_weights", "kwargs": {"weights_path": "/d"}, "version": "3"}) == \
        ("reload_weights", {"weights_path": "/d"}, "3", "wait")
    assert _parse({"method": None, "version": "1", "pause_mode": "keep"}) == (None, {}, "1", "keep")
    for body, words in [([], "JSON object"), ({"version": 3}, "'version'"), ({"method": 1, "version": "1"}, "'method'"),
                        ({"kwargs": {"a": 1}, "version": "1"}, "'kwargs'"),
                        ({"version": "1", "pause_mode": "later"}, "'pause_mode'")]:
        with pytest.raises(ValueError, match=words):
            _parse(body)


def test_plugin_allowlist_keeps_the_users_plugins():
    from importlib.metadata import entry_points

    installed = [p.name for g in ("vllm.general_plugins", "vllm.platform_plugins") for p in entry_points(group=g)]
    unset = plugin_allowlist(None).split(",")
    assert "vime" in installed  # vime's own general plugin (in_vllm.general_plugin)
    assert unset == list(dict.fromkeys(installed))  # vLLM's default (load them all), vime's route included
    assert plugin_allowlist("a,b") == "a,b,vime"
    assert plugin_allowlist("vime,a") == "vime,a"
    assert plugin_allowlist("") == "vime"


class _Engine(BaseHTTPRequestHandler):
    """Answers the control routes like a vLLM server without vime's plugin, recording each call."""

    calls: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        url = urlparse(self.path)
        self.calls.append((url.path, url.query, body))
        if url.path == ROUTE:
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"detail":"Not Found"}')
            return
        answer = {"results": ["loaded"]} if url.path == "/collective_rpc" else {"ok": True}
        payload = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def old_engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    _Engine.calls = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield url
    finally:
        server.shutdown()


def test_engine_without_the_route_gets_the_same_steps_as_separate_calls(old_engine):
    call = ("reload_weights", {"weights_path": "/dev/shm/w"})
    answer = client.update_weights_all(TOKEN, [old_engine], {old_engine: call}, 7, pause_mode="keep")[0]
    assert answer["results"] == ["loaded"] and set(answer["timings"]) == {"pause_s", "load_s", "finish_s"}
    assert [(path, query) for path, query, _ in _Engine.calls] == [
        # kept requests are preempted at the reset: their KV is recomputed under the new weights
        (ROUTE, ""), ("/pause", "mode=keep"), ("/collective_rpc", ""),
        ("/reset_prefix_cache", "reset_running_requests=true"),
        ("/update_weight_version", ""), ("/resume", "")]
    assert _Engine.calls[2][2] == {"method": "reload_weights", "kwargs": {"weights_path": "/dev/shm/w"}}
    assert _Engine.calls[4][2] == {"new_version": "7"}
    # Nothing remembered between updates (no process state): the route is asked again, one 404; with nothing to
    # load, no RPC.
    _Engine.calls.clear()
    client.update_weights_all(TOKEN, [old_engine], {}, 8)
    assert [path for path, _, _ in _Engine.calls] == [ROUTE, "/pause", "/reset_prefix_cache",
                                                       "/update_weight_version", "/resume"]


def test_a_failed_engine_is_named_and_the_others_still_update(old_engine):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    answers, errors = client.update_weights_each(TOKEN, [old_engine, dead], {}, 2)
    assert list(answers) == [old_engine] and list(errors) == [dead] and dead in errors[dead]
    with pytest.raises(client.EngineControlError, match="127.0.0.1:9"):
        client.update_weights_all(TOKEN, [old_engine, dead], {}, 3)


def test_idle_spin_cap_applies_to_readers_only():
    from vime.engine.in_vllm.general_plugin import cap_idle_spin

    class Spin:  # vLLM's SpinCondition shape: readers busy-wait busy_loop_s after a message
        def __init__(self, is_reader, context=None, notify_address="", busy_loop_s=1):
            self.is_reader, self.busy_loop_s = is_reader, busy_loop_s if is_reader else 0

    cap_idle_spin(Spin, 0.05)
    cap_idle_spin(Spin, 0.5)  # a second load of the plugin changes nothing
    assert Spin(True).busy_loop_s == 0.05 and Spin(True, busy_loop_s=0.01).busy_loop_s == 0.01
    assert Spin(False).busy_loop_s == 0


def test_engine_core_fork_patch(monkeypatch):
    """VIME_ENGINE_CORE_FORK=1: vLLM's engine-core launcher gets a fork context (its CPU platform forces spawn,
    whose fresh import of vLLM was most of an engine's start); loading the plugin twice changes nothing."""
    from vllm.v1.engine import utils as engine_utils

    from vime.engine.in_vllm.general_plugin import fork_engine_core

    monkeypatch.setattr(engine_utils, "get_mp_context", engine_utils.get_mp_context)  # restored after the test
    fork_engine_core()
    patched = engine_utils.get_mp_context
    fork_engine_core()
    assert engine_utils.get_mp_context is patched and patched().get_start_method() == "fork"


def test_a_prefix_cache_the_engine_could_not_reset_fails_the_update(monkeypatch):
    sent = []
    monkeypatch.setattr(client, "post_all", lambda token, urls, route, body=None, params=None: sent.append(params) or
                        [{"success": True}, {"success": False}])
    with pytest.raises(client.EngineControlError, match=r"\['http://b'\]: the prefix cache could not be reset"):
        client.reset_prefix_cache(TOKEN, ["http://a", "http://b"], running_requests=True)
    assert sent == [{"reset_running_requests": "true"}]
