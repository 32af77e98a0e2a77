"""The OpenAI endpoint's episode credentials and limits: only open episodes' 128-bit tokens are served, a closed
episode leaves no state (not even after a call that was in flight), 10,000 episodes leave memory where it was,
the body cap answers 413, and /health stays fast while a large request is prepared. A fake token-in/token-out
router stands behind the real endpoint (the real engine path is tests/e2e/test_openai_endpoint_e2e.py)."""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import socket
import threading
import time
import tracemalloc
import urllib.request

import aiohttp
import openai
import pytest
from aiohttp import web

from vime.agents.chat_session import ChatSession
from vime.agents.openai_requests import parse_body
from vime.agents.openai_server import OpenAIServer
from vime.utils.auth import RunToken

USER = [{"role": "user", "content": "hi"}]


class FakeRouter:
    """Answers /inference/v1/generate with two tokens; counts requests; `hold()` keeps answers back until
    `release()` (to close an episode while one of its calls is in flight)."""

    def __init__(self):
        self.calls = 0
        self.authorizations = set()  # the Authorization headers the engines were sent
        self.arrived = threading.Event()
        self.go = threading.Event()
        self.go.set()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        app = web.Application(client_max_size=2**30)
        app.router.add_post("/inference/v1/generate", self._generate)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _generate(self, request):
        await request.read()
        self.calls += 1
        self.authorizations.add(request.headers.get("Authorization"))
        self.arrived.set()
        while not self.go.is_set():
            await asyncio.sleep(0.005)
        return web.json_response({"choices": [{"token_ids": [40, 41], "finish_reason": "length",
                                               "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}]})

    def hold(self):
        self.arrived.clear()
        self.go.clear()

    def release(self):
        self.go.set()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


@pytest.fixture
def endpoint(tokenizer):
    router = FakeRouter()
    server = OpenAIServer(router.url, tokenizer, RunToken.new(), retries=0).start()
    try:
        yield server, router
    finally:
        server.stop()
        router.stop()


def _client(server, api_key):
    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=30)


def _chat(client):
    return client.chat.completions.create(model="policy", messages=USER)


def _post(server, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json",
                                                                         **headers})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_only_open_episodes_tokens_are_served(endpoint):
    server, router = endpoint
    calls = router.calls
    token, other = server.open_episode(), server.open_episode()
    assert len(token) == 32 and set(token) <= set("0123456789abcdef") and token != other  # 128 random bits
    server.close_episode(other)
    status, body = _post(server, json.dumps({"messages": USER}).encode(), {"Authorization": "Bearer guess-7"})
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key" and "session id" in body["error"]["message"]
    for key in ("0" * 32, token[:-1], token + "x", "guess-7/solver"):
        with pytest.raises(openai.AuthenticationError):
            _chat(_client(server, key))
    status, _ = _post(server, json.dumps({"messages": USER, "user": "0" * 32}).encode(), {})
    assert status == 401  # the body's `user` is checked the same way
    status, _ = _post(server, json.dumps({"messages": USER}).encode(), {})
    assert status == 401  # no id at all
    assert router.calls == calls  # nothing refused reached the engines

    assert _chat(_client(server, f"{token}/solver")).choices[0].message.content is not None
    status, _ = _post(server, json.dumps({"messages": USER, "user": token}).encode(), {})
    assert status == 200
    sessions = server.close_episode(token)
    assert list(sessions) == [f"{token}/solver", token]
    for key in (token, f"{token}/solver", f"{token}/checker"):
        with pytest.raises(openai.AuthenticationError):  # closed: refused, and nothing re-created
            _chat(_client(server, key))
    assert server.close_episode(token) == {}
    assert router.calls == calls + 2 and server.episodes == {}
    assert router.authorizations == {f"Bearer {server.run_token.serving_key()}"}  # the run's key, not the episode's


def test_a_relay_names_sessions_by_public_id_and_proves_itself_with_its_key(endpoint):
    """A relay (verifiers' interception server) that may write its session ids on a command line names them by
    the episode's public id and carries the relay key: the public id alone, a wrong key, or the key with an id no
    open episode has, are refused; the calls land in the episode's own sessions."""
    from vime.agents.openai_requests import public_id

    server, router = endpoint
    calls = router.calls
    token, key = server.open_episode(), server.relay_key()
    server.bind_relay(token, key)
    public = public_id(token)
    assert public != token and token not in public and key != token
    body = json.dumps({"messages": USER}).encode()
    for headers in ({"X-Session-ID": public},  # no key: the public id is no credential
                    {"X-Session-ID": public, "Authorization": f"Bearer {token}"},  # a key that is not a relay's
                    {"X-Session-ID": public_id("0" * 32), "Authorization": f"Bearer {key}"},  # no such episode
                    {"X-Session-ID": f"{public}/solver", "Authorization": "Bearer " + "0" * 32}):
        assert _post(server, body, headers)[0] == 401, headers
    assert router.calls == calls
    assert _post(server, body, {"X-Session-ID": public, "authorization": f"bearer {key}"})[0] == 200
    assert _post(server, body, {"X-Session-ID": f"{public}/solver", "Authorization": f"Bearer {key}"})[0] == 200
    assert list(server.close_episode(token)) == [token, f"{token}/solver"]
    assert _post(server, body, {"X-Session-ID": public, "Authorization": f"Bearer {key}"})[0] == 401  # closed
    assert server.episodes == {} and router.calls == calls + 2


def test_a_relay_key_opens_only_the_episodes_bound_to_it(endpoint):
    """Two relays (two verifiers bridges), each with its own key and episodes: a program that read one relay's key
    and another relay's public ids (from `ps`) still cannot call into that relay's episodes, nor into an episode
    bound to no relay; each relay reaches its own."""
    from vime.agents.openai_requests import public_id

    server, router = endpoint
    calls = router.calls
    mine, theirs, unbound = server.open_episode(), server.open_episode(), server.open_episode()
    my_key, their_key = server.relay_key(), server.relay_key()
    server.bind_relay(mine, my_key)
    server.bind_relay(theirs, their_key)
    body = json.dumps({"messages": USER}).encode()
    for episode in (theirs, unbound):
        for session in (public_id(episode), f"{public_id(episode)}/solver"):
            assert _post(server, body, {"X-Session-ID": session, "Authorization": f"Bearer {my_key}"})[0] == 401
    assert router.calls == calls
    assert _post(server, body, {"X-Session-ID": public_id(mine), "Authorization": f"Bearer {my_key}"})[0] == 200
    assert _post(server, body, {"X-Session-ID": public_id(theirs), "Authorization": f"Bearer {their_key}"})[0] == 200
    assert [list(server.close_episode(t)) for t in (mine, theirs, unbound)] == [[mine], [theirs], []]
    with pytest.raises(KeyError):  # a closed episode cannot be bound again
        server.bind_relay(mine, my_key)
    assert router.calls == calls + 2


def test_a_call_in_flight_when_its_episode_closes_is_refused_and_leaves_nothing(endpoint):
    server, router = endpoint
    token = server.open_episode()
    client = _client(server, f"{token}/a")
    _chat(client)
    router.hold()
    statuses = []

    def call():
        try:
            _chat(client)
        except openai.APIStatusError as e:
            statuses.append(e.status_code)

    callers = [threading.Thread(target=call) for _ in range(2)]
    for caller in callers:
        caller.start()
    try:
        assert router.arrived.wait(10)  # one call is at the engine
        time.sleep(0.2)  # the other waits for the session's lock
        sessions = server.close_episode(token)
    finally:
        router.release()
    for caller in callers:
        caller.join(30)
    assert statuses == [401, 401]
    (session,) = sessions.values()
    assert [len(t.turns) for t in session.trajectories] == [1]  # the handed-over session was not extended
    assert server.episodes == {} and server.session(f"{token}/a") is None


def _alive(*types) -> int:
    return sum(type(o) in types for o in gc.get_objects())


def test_ten_thousand_episodes_leave_no_sessions_locks_or_memory(endpoint):
    server, router = endpoint
    body = json.dumps({"messages": USER, "max_tokens": 2}).encode()

    async def episodes(n: int) -> None:
        async with aiohttp.ClientSession(base_url=f"http://{server.host}:{server.port}") as http:
            async def post(session_id: str) -> int:
                async with http.post("/v1/chat/completions", data=body,
                                     headers={"Authorization": f"Bearer {session_id}"}) as r:
                    await r.read()
                    return r.status

            async def episode(i: int) -> None:
                token = server.open_episode({"max_tokens": 2})
                if i % 4 == 0:  # one call in a quarter of the episodes, none in the rest
                    assert await post(f"{token}/r{i % 3}") == 200
                assert len(server.close_episode(token)) == (i % 4 == 0)
                if i % 20 == 0:  # a late call: refused, creates nothing
                    assert await post(token) == 401

            for start in range(0, n, 25):
                await asyncio.gather(*(episode(i) for i in range(start, start + 25)))

    asyncio.run(episodes(200))  # warm-up: connections, thread pool, tokenizer caches
    gc.collect()
    objects = _alive(ChatSession, asyncio.Lock)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        asyncio.run(episodes(10_000))
        seconds = time.perf_counter() - t0
        time.sleep(0.2)  # the server drops the closed connections' handlers on its own loop
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert router.calls == 50 + 2500  # the warm-up's and these episodes' calls, none of the late ones
    assert server.episodes == {} and _alive(ChatSession, asyncio.Lock) == objects
    # What remains is aiohttp's per-connection state (~170 KiB here); leaking only the 2,500 sessions' locks
    # would add ~650 KiB.
    assert grown < 384 * 2**10, f"{grown} bytes more after 10,000 episodes ({seconds:.1f} s)"


def test_request_body_cap_answers_413(endpoint, tokenizer):
    _, router = endpoint
    server = OpenAIServer(router.url, tokenizer, RunToken.new(), max_request_bytes=2**20).start()
    try:
        token = server.open_episode()
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 * 2**20)}]}).encode()
        status, body = _post(server, big, {"Authorization": f"Bearer {token}"})
        assert status == 413 and "--agent-endpoint-max-request-mb" in body["error"]["message"]

        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)  # no Content-Length: chunked
        conn.request("POST", "/v1/chat/completions", body=iter([big[:2**19]] * 4), encode_chunked=True,
                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["code"] == 413
        conn.close()
        assert server.close_episode(token) == {}
    finally:
        server.stop()
    with pytest.raises(ValueError, match="max-request-mb"):
        OpenAIServer(router.url, tokenizer, RunToken.new(), max_request_bytes=0)


def _health_during(server, body: bytes, token: str) -> tuple[int, dict, list[float], float]:
    """(status, answer, /health latencies, seconds) of a chat request sent while /health is polled."""
    result = {}

    def send():
        result["status"], result["body"] = _post(server, body, {"Authorization": f"Bearer {token}"})

    health = f"http://{server.host}:{server.port}/health"
    sender = threading.Thread(target=send)
    t0 = time.perf_counter()
    sender.start()
    latencies = []
    while sender.is_alive():
        t = time.perf_counter()
        with urllib.request.urlopen(health, timeout=10) as r:
            assert r.status == 200
        latencies.append(time.perf_counter() - t)
        time.sleep(0.005)
    sender.join()
    return result["status"], result["body"], latencies, time.perf_counter() - t0


def _with_image(text: str, size: int) -> bytes:
    """A chat body of about `size` bytes: `text`, and an image part the text-only template does not render
    (parsed, never tokenized)."""
    content = [{"type": "text", "text": text},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * (size - len(text))}}]
    return json.dumps({"messages": [{"role": "user", "content": content}]}).encode()


def test_health_stays_fast_while_a_large_request_is_prepared(endpoint):
    """A body at the default cap (16 MiB) with 256 KiB of text, which takes the tokenizer a few hundred
    milliseconds, is served; a 60 MiB body is refused (413) without being parsed. /health stays under 100 ms
    during both."""
    server, _ = endpoint
    token = server.open_episode({"max_tokens": 2})
    body = _with_image("count the words " * 16384, server.max_request_bytes - 4096)
    assert len(body) <= server.max_request_bytes == 16 * 2**20
    status, answer, latencies, seconds = _health_during(server, body, token)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] > 16384  # the text was rendered and tokenized
    assert len(latencies) >= 5, f"the request took {seconds:.2f} s: too short to measure /health during it"
    assert max(latencies) < 0.1, f"/health took up to {max(latencies) * 1000:.0f} ms during a {seconds:.2f} s request"

    status, answer, latencies, seconds = _health_during(server, _with_image("hi", 60 * 2**20), token)
    assert status == 413 and "--agent-endpoint-max-request-mb" in answer["error"]["message"]
    assert max(latencies, default=0) < 0.1, f"/health took up to {max(latencies) * 1000:.0f} ms"
    assert [len(t.turns) for t in server.close_episode(token)[token].trajectories] == [1]


def test_parse_body_says_what_is_wrong():
    assert parse_body(['{"messages": [', "]}"]) == {"messages": []}
    with pytest.raises(ValueError, match="JSON object"):
        parse_body(["[1, 2]"])
    with pytest.raises(ValueError, match="not JSON"):
        parse_body(["{"])
    with pytest.raises(ValueError, match="not JSON"):
        parse_body(["[" * 200_000])


def _answer_to_headers(server, headers: dict[str, str], timeout_s: float = 10.0) -> bytes:
    """The status line and headers the endpoint answers to a POST whose headers alone were sent (its body never
    is): raises socket.timeout when the endpoint waits for the body instead."""
    lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: {server.host}", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection((server.host, server.port), timeout=timeout_s) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        return answer


def test_a_caller_without_a_credential_is_refused_before_its_body_is_read(endpoint):
    """No session id in the headers: the body (where `user` could name one) is not read past 64 KiB, whatever
    its Content-Length; a wrong key is refused before any of it; an open episode's key over the cap gets 413
    before it is read. Each answer comes while the body is still unsent."""
    server, router = endpoint
    token = server.open_episode()
    calls = router.calls
    for length in (8 * 2**20, 2**40):  # under the endpoint's cap, and far over it
        answer = _answer_to_headers(server, {"Content-Length": str(length)})
        assert answer.startswith(b"HTTP/1.1 401"), (length, answer[:200])
    answer = _answer_to_headers(server, {"Content-Length": str(8 * 2**20), "Authorization": "Bearer guess"})
    assert answer.startswith(b"HTTP/1.1 401")
    answer = _answer_to_headers(server, {"Content-Length": str(2**40), "Authorization": f"Bearer {token}"})
    assert answer.startswith(b"HTTP/1.1 413")

    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)  # no Content-Length: chunked
    conn.request("POST", "/v1/chat/completions", body=iter([b" " * 2**15] * 8), encode_chunked=True,
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 401 and "API key" in json.loads(response.read())["error"]["message"]
    conn.close()
    assert router.calls == calls and server.close_episode(token) == {}


def test_calls_beyond_max_in_flight_are_answered_503_at_once(endpoint, tokenizer):
    _, router = endpoint
    server = OpenAIServer(router.url, tokenizer, RunToken.new(), retries=0, max_in_flight=2).start()
    token = server.open_episode()
    body = json.dumps({"messages": USER}).encode()
    statuses = []

    def call(role: str):
        statuses.append(_post(server, body, {"Authorization": f"Bearer {token}/{role}"})[0])

    calls = router.calls
    router.hold()
    held = [threading.Thread(target=call, args=(role,)) for role in ("a", "b")]
    try:
        for caller in held:
            caller.start()
        deadline = time.monotonic() + 30
        while router.calls < calls + 2 and time.monotonic() < deadline:  # both wait at the engine
            time.sleep(0.01)
        assert router.calls == calls + 2
        for headers in ({"Authorization": f"Bearer {token}/c"}, {}):  # served or not, nothing is read
            answer = _answer_to_headers(server, {"Content-Length": str(len(body)), **headers})
            assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer[:300]
    finally:
        router.release()
        for caller in held:
            caller.join(30)
    try:
        assert statuses == [200, 200]
        assert _post(server, body, {"Authorization": f"Bearer {token}/c"})[0] == 200  # room again
        assert server.slots.taken == 0 and router.calls == calls + 3
    finally:
        server.stop()
    with pytest.raises(ValueError, match="max_in_flight"):
        OpenAIServer(router.url, tokenizer, RunToken.new(), max_in_flight=0)
