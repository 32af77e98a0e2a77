"""An OpenAI-compatible chat endpoint in front of the policy: "string in, tokens out".

An existing agent harness points the `openai` client at it and chats; vime records, per session, the exact
token ids the engines saw and sampled, the loss mask, log-probs and weight versions (`chat_session.py`).

    server = OpenAIServer(router_url, tokenizer).start()     # -> "http://127.0.0.1:PORT/v1"
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="episode-7/solver")
    await client.chat.completions.create(model="policy", messages=[...], max_tokens=64)
    server.close_episode("episode-7")                          # -> {"episode-7/solver": ChatSession}

Session id, first found wins: header `X-Session-ID`, the API key (`Authorization: Bearer <id>`, what every
OpenAI client sets), then the body's `user`. An id "EPISODE/ROLE" is the ROLE agent of EPISODE.
Routes: POST /v1/chat/completions (no streaming, n=1), GET /v1/models, GET /health.

Each call goes token-in/token-out to `/inference/v1/generate` through vllm-router (`request_generate`, retried
like the rollout's own requests) with the header
`X-Session-ID: <session id>`. vllm-router 0.1.17's `consistent_hash` policy hashes that header first (then
X-User-ID, ..., the body's session_params.session_id / user, else the whole body), so with
`--router-policy consistent_hash` every call of a session reaches the same engine and reuses its prefix cache.

The server runs on its own event loop in a daemon thread, so a harness may use the sync or the async client
from any thread of the rollout process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
import zlib
from typing import Any

import aiohttp
from aiohttp import web

from vime.agents.chat_session import ChatSession, ChatTemplate
from vime.backends.vllm_utils.generate_request import (EngineRejectedError, EngineUnavailableError, RequestCounters,
                                                       request_generate)

logger = logging.getLogger(__name__)
MODEL_NAME = "policy"
SESSION_HEADER = "X-Session-ID"


def session_id_of(headers, body: dict[str, Any]) -> str | None:
    if headers.get(SESSION_HEADER):
        return headers[SESSION_HEADER]
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    user = body.get("user")
    return str(user) if user else None


def episode_of(session_id: str) -> str:
    return session_id.split("/", 1)[0]


def engine_sampling_params(body: dict[str, Any], defaults: dict[str, Any], forced: dict[str, Any]) -> dict[str, Any]:
    """vLLM sampling params for one chat call: the request's OpenAI fields over `defaults`, then `forced`
    (an RL run forces its temperature/top-p/top-k: the trainer's log-probs use them)."""
    p = dict(defaults)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        p["max_tokens"] = int(max_tokens)
    for key in ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "min_tokens"):
        if body.get(key) is not None:
            p[key] = body[key]
    stop = body.get("stop")
    if stop:
        p["stop"] = [stop] if isinstance(stop, str) else list(stop)
    p.update({k: v for k, v in forced.items() if v is not None})
    if "max_tokens" in forced and max_tokens is not None:  # forced max_tokens is a cap, not a value
        p["max_tokens"] = min(int(max_tokens), int(forced["max_tokens"]))
    p["logprobs"] = 0  # the sampled token's own log-prob
    p["skip_special_tokens"] = False
    return p


def call_seed(seed: int, session_id: str, call_index: int) -> int:
    """A distinct, reproducible seed per (session, call), so roles sharing an episode seed do not sample alike."""
    return (int(seed) + zlib.crc32(session_id.encode()) + 7919 * call_index) % 2**31


def reply_text(tokenizer, sampled: list[int], stop: list[str] | None) -> str:
    """What the client sees: the sampled text without special tokens, cut before a stop string (OpenAI)."""
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    for s in stop or []:
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    return text


class EngineError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class OpenAIServer:
    def __init__(self, router_url: str, tokenizer, template_kwargs: dict | None = None,
                 default_sampling: dict[str, Any] | None = None, host: str = "127.0.0.1", port: int = 0,
                 request_timeout_s: float = 600.0, retries: int = 2, retry_window_s: float = 0.0):
        self.router_url = router_url.rstrip("/")
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer, template_kwargs)
        self.defaults = {"max_tokens": 256, "temperature": 1.0, "top_p": 1.0, **(default_sampling or {})}
        self.host, self.port = host, port
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.retries, self.retry_window_s = retries, retry_window_s
        self.counters = RequestCounters()  # in flight and retried through this endpoint
        self.sessions: dict[str, ChatSession] = {}
        self.forced: dict[str, dict[str, Any]] = {}  # episode -> sampling params forced on its calls
        self._locks: dict[str, asyncio.Lock] = {}
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="vime-openai-server", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout_s)
        logger.info("OpenAI-compatible endpoint at %s -> %s", self.base_url, self.router_url)
        return self

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the real port when 0 was asked
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    def stop(self) -> None:
        if self._loop is None:
            return

        async def _close():
            if self._http is not None:
                await self._http.close()
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(_close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop = None

    # ---- episodes (thread-safe: the harness calls these from the rollout's loop) -------------------------------
    def open_episode(self, episode: str, forced_sampling: dict[str, Any] | None = None) -> None:
        """Force sampling params on every session "EPISODE" or "EPISODE/ROLE" (e.g. the RL run's temperature)."""
        with self._guard:
            self.forced[episode] = dict(forced_sampling or {})

    def close_episode(self, episode: str) -> dict[str, ChatSession]:
        """Remove and return the episode's sessions ({session id: ChatSession}, in order of first call)."""
        with self._guard:
            self.forced.pop(episode, None)
            ids = [sid for sid in self.sessions if episode_of(sid) == episode]
            return {sid: self.sessions.pop(sid) for sid in ids}

    def session(self, session_id: str) -> ChatSession | None:
        with self._guard:
            return self.sessions.get(session_id)

    # ---- routes ----------------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "vime"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        session_id = session_id_of(request.headers, body)
        if not session_id:
            return _error(400, f"no session id: set the {SESSION_HEADER} header or the API key "
                               "(openai.OpenAI(base_url=..., api_key=SESSION_ID))")
        if body.get("stream"):
            return _error(400, "stream=True is not supported by vime's endpoint; call without streaming")
        if body.get("n", 1) != 1:
            return _error(400, "n must be 1")
        with self._guard:
            lock = self._locks.setdefault(session_id, asyncio.Lock())
            forced = self.forced.get(episode_of(session_id), {})
        async with lock:  # one call at a time per session: each call extends the previous one
            try:
                return web.json_response(await self._complete(session_id, body, forced))
            except ValueError as e:
                return _error(400, str(e))
            except EngineError as e:
                return _error(e.status, str(e))

    async def _complete(self, session_id: str, body: dict[str, Any], forced: dict[str, Any]) -> dict[str, Any]:
        with self._guard:
            session = self.sessions.get(session_id) or ChatSession(session_id)
        tools = body.get("tools")
        trajectory, prompt_ids, messages = session.prepare(body.get("messages"), tools, self.template)
        params = engine_sampling_params(body, self.defaults, forced)
        if forced.get("seed") is not None:  # one run seed per episode: vary it per role and call
            params["seed"] = call_seed(forced["seed"], session_id, sum(len(t.turns) for t in session.trajectories))
        choice = await self._generate(session_id, prompt_ids, params)
        sampled = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        log_probs = [c["logprob"] for c in content]
        versions = [str(v["version"]) if isinstance(v, dict) else str(v) for v in choice.get("weight_versions") or []]
        finish = choice.get("finish_reason") or "stop"
        if finish == "abort":  # 422: the openai client does not retry it; the episode ends, nothing recorded
            raise EngineError(422, "generation was aborted (the rollout batch is full or the engines were "
                                   "paused); this episode cannot continue")
        text = reply_text(self.tokenizer, sampled, params.get("stop"))
        session.record(trajectory, prompt_ids, messages, sampled, log_probs, versions, finish, text, self.template)
        with self._guard:
            self.sessions[session_id] = session
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or MODEL_NAME,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "length" if finish == "length" else "stop", "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(sampled),
                      "total_tokens": len(prompt_ids) + len(sampled)},
        }

    async def _generate(self, session_id: str, prompt_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """Token-in/token-out through the router, keyed by session, retried like the rollout's requests."""
        payload = {"token_ids": prompt_ids, "sampling_params": params, "model": MODEL_NAME}
        try:
            return await request_generate(self._http, self.router_url, payload, timeout=self.timeout,
                                          retries=self.retries, retry_window_s=self.retry_window_s,
                                          headers={SESSION_HEADER: session_id}, counters=self.counters)
        except EngineRejectedError as e:
            raise EngineError(400, str(e)) from e
        except EngineUnavailableError as e:
            raise EngineError(502, str(e)) from e


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "api_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
