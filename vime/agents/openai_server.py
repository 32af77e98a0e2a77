"""An OpenAI-compatible chat endpoint in front of the policy: "string in, tokens out".

An existing agent harness points the `openai` client at it and chats; vime records, per session, the exact
token ids the engines saw and sampled, the loss mask, log-probs and weight versions (`chat_session.py`).

    server = OpenAIServer(router_url, tokenizer).start()     # -> "http://127.0.0.1:PORT/v1"
    token = server.open_episode()                              # 128 random bits, e.g. "3f9c...e1"
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=f"{token}/solver")
    await client.chat.completions.create(model="policy", messages=[...], max_tokens=64)
    server.close_episode(token)                                # -> {f"{token}/solver": ChatSession}

Session id, first found wins: header `X-Session-ID`, the API key (`Authorization: Bearer <id>`, what every
OpenAI client sets; `x-api-key`, what the Anthropic client sets), then the body's `user`. An id "TOKEN/ROLE" is
the ROLE agent of the episode TOKEN.

Routes: POST /v1/chat/completions (tools, structured tool_calls, streaming, n, stop, seed, logprobs), POST
/v1/responses (the OpenAI Responses API: input items, function tools, previous_response_id within an episode,
streaming), POST /v1/messages (the Anthropic Messages API: text, tool_use and tool_result blocks, streaming),
GET /v1/models, GET /health. Each API route translates its request into one chat request (`vime.agents.api`);
tools reach the model through its chat template and its tool calls are parsed out of the sampled text
(--agent-tool-call-format). Whatever is returned, the trained tokens are the ones the engine sampled: a reply is
never re-tokenized. A streamed answer is sent once the engine has finished it, with the same content.

Only open episodes are served: the token is the episode's credential (the endpoint may listen on the node's
address on a cluster), so a call with an unknown or closed token gets 401 and records nothing; a call still in
flight when its episode closes is answered 401 too and leaves no state behind. An episode's sessions and locks
live in its `_Episode`, dropped on close, so memory follows the open episodes only.

Each call goes token-in/token-out to `/inference/v1/generate` through vllm-router (`request_choices`, retried
like the rollout's own requests) with the header `X-Session-ID: <routing key>`, a digest of the session id (the
router never sees the token). vllm-router 0.1.17's `consistent_hash` policy hashes that header first (then
X-User-ID, ..., the body's session_params.session_id / user, else the whole body), so with
`--router-policy consistent_hash` every call of a session reaches the same engine and reuses its prefix cache.

The server runs on its own event loop in a daemon thread, so a harness may use the sync or the async client
from any thread of the rollout process. That loop only moves bytes: JSON parsing, template rendering,
tokenization and detokenization run in a thread pool (the tokenizer releases the GIL), so /health and other
sessions stay responsive while a large request is prepared. Bodies over `max_request_bytes` (16 MiB by default,
--agent-endpoint-max-request-mb) get 413: json.loads holds the GIL for the whole body (~90 ms at 60 MiB).
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import hashlib
import json
import logging
import secrets
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from vime.agents.api import anthropic_api, chat_api, responses_api
from vime.agents.api.completion import ChoiceOut, Completion, ToolCallOut, canonical_arguments
from vime.agents.chat_session import ChatSession, ChatTemplate, branch
from vime.agents.tool_parsing import forced_call_schema, split_tool_calls
from vime.backends.vllm_utils.client import SERVED_MODEL
from vime.backends.vllm_utils.generate_request import (EngineRejectedError, EngineUnavailableError, RequestCounters,
                                                       request_choices)

logger = logging.getLogger(__name__)
MODEL_NAME = SERVED_MODEL
SESSION_HEADER = "X-Session-ID"
MAX_SESSION_ID_CHARS = 256  # a token (32 hex digits), "/" and a role name
# json.loads holds the GIL (every thread of the rollout process waits) ~1.5 ms per MiB; a text-only policy's
# longest useful request, a full context window, is well under 1 MiB.
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
MAX_CHOICES = 64  # n: each answer is an engine sequence and a trained sample
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def session_id_of(headers, body: dict[str, Any]) -> str | None:
    if headers.get(SESSION_HEADER):
        return headers[SESSION_HEADER]
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    if headers.get("x-api-key"):
        return headers["x-api-key"]
    user = body.get("user")
    return str(user) if user else None


def episode_of(session_id: str) -> str:
    return session_id.split("/", 1)[0]


def token_key(token: str) -> bytes:
    """What an episode is filed under: the token's SHA-256. Lookups then compare digests, never the token itself,
    so their timing says nothing about how much of a guessed token is right."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def routing_key(session_id: str) -> str:
    """The router's affinity key for a session: stable per session, and no use as a credential."""
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class BodyTooLarge(Exception):
    pass


async def read_text(request: web.Request, max_bytes: int) -> list[str]:
    """The request body as text pieces, decoded chunk by chunk as it arrives: every step on the event loop stays
    short (one `bytes(body)` or `decode` of a large body would hold it for tens of milliseconds)."""
    if (request.content_length or 0) > max_bytes:
        raise BodyTooLarge
    decoder = codecs.getincrementaldecoder("utf-8")()
    pieces, size = [], 0
    try:
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge
            pieces.append(decoder.decode(chunk))
        pieces.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError as e:
        raise ValueError(f"the request body is not UTF-8 ({e})") from e
    return pieces


def parse_body(pieces: list[str]) -> dict[str, Any]:
    """A chat request's JSON object from its text pieces (run off the event loop: ~1.5 ms per MiB)."""
    try:
        body = json.loads("".join(pieces))
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser's stack
        raise ValueError(f"the request body is not JSON ({e})") from e
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


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
    n = 1 if body.get("n") is None else body["n"]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n must be an integer from 1 to {MAX_CHOICES}, got {n!r}")
    if n > 1:
        p["n"] = n
    p["logprobs"] = top_logprobs(body)  # 0: the sampled token's own log-prob, always recorded
    p["skip_special_tokens"] = False
    return p


def top_logprobs(body: dict[str, Any]) -> int:
    """How many alternatives per token the request asked for (`logprobs: true` with `top_logprobs`)."""
    k = 0 if body.get("top_logprobs") is None else body["top_logprobs"]
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {k!r}")
    if k and not body.get("logprobs"):
        raise ValueError("top_logprobs needs logprobs: true")
    return k


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


def text_pieces(tokenizer, sampled: list[int], text: str) -> list[str]:
    """The answer's text as one piece per sampled token, for streaming, when the text is the plain decoding of
    the tokens (else the whole text as one piece: tool-call markup or a stop string was cut out of it)."""
    pieces, previous = [], ""
    for i in range(1, len(sampled) + 1):
        current = tokenizer.decode(sampled[:i], skip_special_tokens=True)
        if not current.startswith(previous) or "\ufffd" in current[len(previous):]:
            continue  # a token that completes a multi-byte character: its text comes with the next one
        if current != previous:
            pieces.append(current[len(previous):])
        previous = current
    return pieces if "".join(pieces) == text else ([text] if text else [])


def openai_logprobs(tokenizer, entries: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """The engine's per-token log-probs (token ids; the sampled token first, then candidates by rank) in
    OpenAI's chat form: token text, log-prob, UTF-8 bytes and the `top` best alternatives."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    out = []
    for entry in entries:
        ranked = sorted(entry.get("top_logprobs") or [], key=lambda c: (c.get("rank") or 0))
        alternatives, seen = [], set()
        for candidate in ranked:
            if candidate["token_id"] not in seen and len(alternatives) < top:
                seen.add(candidate["token_id"])
                alternatives.append(one(candidate["token_id"], candidate["logprob"]))
        out.append({**one(entry["token_id"], entry["logprob"]), "top_logprobs": alternatives})
    return out


class EngineError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EpisodeClosed(Exception):
    """The call's episode closed while the call ran: nothing is recorded."""


@dataclass
class _Episode:
    """One open episode: the sampling params forced on its calls, the served model they ask the engines for,
    its sessions (in order of first recorded call) and one lock per session. All of it goes when the episode
    closes."""

    forced: dict[str, Any]
    model: str = MODEL_NAME  # a multi-LoRA run's episode: its sample's adapter, whatever model the agent names
    sessions: dict[str, ChatSession] = field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # Responses API: response id -> its conversation in chat form (request messages + answer), for the
    # episode's calls that continue it by previous_response_id.
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    open: bool = True


class OpenAIServer:
    def __init__(self, router_url: str, tokenizer, template_kwargs: dict | None = None,
                 default_sampling: dict[str, Any] | None = None, host: str = "127.0.0.1", port: int = 0,
                 request_timeout_s: float = 600.0, retries: int = 2, retry_window_s: float = 0.0,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, prepare_threads: int = 4,
                 tool_call_format: str = "auto"):
        self.router_url = router_url.rstrip("/")
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer, template_kwargs)
        self.tool_call_format = tool_call_format  # how tool calls are parsed out of replies (tool_parsing)
        self.defaults = {"max_tokens": 256, "temperature": 1.0, "top_p": 1.0, **(default_sampling or {})}
        self.host, self.port = host, port
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.retries, self.retry_window_s = retries, retry_window_s
        if max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes is {max_request_bytes}; give a positive limit "
                             "(--agent-endpoint-max-request-mb)")
        self.max_request_bytes = int(max_request_bytes)
        self.counters = RequestCounters()  # in flight and retried through this endpoint
        self.episodes: dict[bytes, _Episode] = {}  # open episodes by token_key(token)
        self._guard = threading.Lock()  # episodes and their sessions: the harness opens/closes from its thread
        self._pool = ThreadPoolExecutor(prepare_threads, thread_name_prefix="vime-openai-prepare")
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
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/messages", self._messages)
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
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- episodes (thread-safe: the harness calls these from the rollout's loop) -------------------------------
    def open_episode(self, forced_sampling: dict[str, Any] | None = None, model: str = MODEL_NAME) -> str:
        """A new episode's token (128 random bits): its agents use it, or "TOKEN/ROLE", as their API key.
        `forced_sampling` is imposed on each of its calls (e.g. the RL run's temperature); every call asks the
        engines for the served `model` (the sample's adapter in a multi-LoRA run)."""
        token = secrets.token_hex(16)
        with self._guard:
            self.episodes[token_key(token)] = _Episode(dict(forced_sampling or {}), model)
        return token

    def close_episode(self, token: str) -> dict[str, ChatSession]:
        """End an episode and hand over its sessions ({session id: ChatSession}, in order of first call); its
        token is refused from now on. {} for an unknown or already closed token."""
        with self._guard:
            episode = self.episodes.pop(token_key(token), None)
            if episode is None:
                return {}
            episode.open = False
            episode.locks.clear()  # a call waiting on one still holds it, and finds the episode closed
            return episode.sessions

    def session(self, session_id: str) -> ChatSession | None:
        episode = self._episode(session_id)
        if episode is None:
            return None
        with self._guard:
            return episode.sessions.get(session_id)

    def _episode(self, session_id: str) -> _Episode | None:
        with self._guard:
            return self.episodes.get(token_key(episode_of(session_id)))

    # ---- routes ----------------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "vime"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        """OpenAI chat completions."""
        async def run(episode, session_id, body):
            completion = await self._call(episode, session_id, body)
            if not body.get("stream"):
                return web.json_response(chat_api.completion_object(completion))
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = chat_api.stream_chunks(completion, include_usage)
            return await _send_events(request, [(None, c) for c in chunks], done_marker=True)

        return await self._route(request, run, _error)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """The OpenAI Responses API: translated into a chat call; previous_response_id continues a response
        of the same episode."""
        async def run(episode, session_id, body):
            previous = None
            if body.get("previous_response_id"):
                with self._guard:
                    previous = episode.responses.get(str(body["previous_response_id"]))
                if previous is None:
                    raise ValueError(f"previous_response_id {body['previous_response_id']!r} is not a response of "
                                     "this episode (responses live as long as their episode)")
            chat_body = await self._off_loop(responses_api.chat_request, body, previous)
            completion = await self._call(episode, session_id, chat_body, id_prefix="resp_")
            with self._guard:
                if episode.open:
                    episode.responses[completion.id] = (chat_body["messages"]
                                                        + [completion.choices[0].chat_message()])
            if body.get("stream"):
                return await _send_events(request, responses_api.stream_events(completion, body))
            return web.json_response(responses_api.response_object(completion, body))

        return await self._route(request, run, _error)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API: translated into a chat call."""
        async def run(episode, session_id, body):
            chat_body = await self._off_loop(anthropic_api.chat_request, body)
            completion = await self._call(episode, session_id, chat_body, id_prefix="msg_")
            if body.get("stream"):
                return await _send_events(request, anthropic_api.stream_events(completion))
            return web.json_response(anthropic_api.message_object(completion))

        def error(status: int, message: str, code: str | int | None = None) -> web.Response:
            return web.json_response(anthropic_api.error_body(status, message), status=status)

        return await self._route(request, run, error)

    async def _route(self, request: web.Request, run, error) -> web.StreamResponse:
        """What every API route does around its own part (`run(episode, session_id, body)`): the session id
        and its open episode, the body within its size limit, one call at a time per session, and errors in the
        route's own shape (`error(status, message, code)`)."""
        session_id = session_id_of(request.headers, {})
        if session_id is not None and self._episode(session_id) is None:
            return _unauthorized(error)  # before reading a body that would not be served
        try:
            body = await self._off_loop(parse_body, await read_text(request, self.max_request_bytes))
        except BodyTooLarge:
            return error(413, f"the request body is over the endpoint's limit of {self.max_request_bytes} bytes; "
                              "raise --agent-endpoint-max-request-mb or send less")
        except ValueError as e:
            return error(400, str(e))
        session_id = session_id or session_id_of({}, body)
        if not session_id:
            return error(401, f"no session id: set the API key to the episode's session id "
                              f"(openai.OpenAI(base_url=..., api_key=SESSION_ID)) or the {SESSION_HEADER} header",
                         "invalid_api_key")
        if len(session_id) > MAX_SESSION_ID_CHARS:
            return error(400, f"the session id is {len(session_id)} characters, over {MAX_SESSION_ID_CHARS}; "
                              "use the episode's token with a short role name, TOKEN/ROLE")
        episode = self._episode(session_id)
        if episode is None:
            return _unauthorized(error)
        with self._guard:
            if not episode.open:  # closed since the lookup: a lock now would outlive it
                return _unauthorized(error)
            lock = episode.locks.setdefault(session_id, asyncio.Lock())
        async with lock:  # one call at a time per session: each call extends the previous one
            try:
                return await run(episode, session_id, body)
            except EpisodeClosed:
                return _unauthorized(error)
            except ValueError as e:
                return error(400, str(e))
            except EngineError as e:
                return error(e.status, str(e))

    async def _call(self, episode: _Episode, session_id: str, body: dict[str, Any],
                    id_prefix: str = "chatcmpl-") -> Completion:
        """One chat call (an OpenAI chat request body, whichever API it came through): generate, parse the
        answers, record each as a trained trajectory of the session."""
        with self._guard:
            if not episode.open:
                raise EpisodeClosed
            session = episode.sessions.get(session_id) or ChatSession(session_id)
        tools = body.get("tools") or None
        tool_choice = body.get("tool_choice")
        if tool_choice == "none":  # the model is not shown the tools, and nothing is parsed as a call
            tools = None
        trajectory, prompt_ids, messages = await self._off_loop(session.prepare, body.get("messages"), tools,
                                                                self.template, tool_choice if tools else None)
        forced = episode.forced
        params = engine_sampling_params(body, self.defaults, forced)
        if forced.get("seed") is not None:  # one run seed per episode: vary it per role and call
            params["seed"] = call_seed(forced["seed"], session_id, sum(len(t.turns) for t in session.trajectories))
        required = tools is not None and (tool_choice == "required" or isinstance(tool_choice, dict))
        # the reply must be a call: the engine's structured output holds it to one. Whether JSON whitespace is
        # allowed in it is the engine's setting (vLLM 0.32 reads disable_any_whitespace from
        # --structured-outputs-config only; README: agent endpoint)
        if required:
            name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
            params["structured_outputs"] = {"json": forced_call_schema(tools, name)}
        choices = await self._generate(session_id, prompt_ids, params, episode.model)
        if any(c.get("finish_reason") == "abort" for c in choices):
            # 422: the openai client does not retry it; the episode ends, nothing recorded
            raise EngineError(422, "generation was aborted (the rollout batch is full or the engines were "
                                   "paused); this episode cannot continue")
        call_format = None if tools is None else ("json" if required else self.tool_call_format)
        answers = await self._off_loop(self._answers, choices, params, call_format, bool(body.get("logprobs")))
        await self._off_loop(self._record, episode, session, trajectory, prompt_ids, messages, choices, answers)
        return Completion(id=f"{id_prefix}{uuid.uuid4().hex}", model=body.get("model") or MODEL_NAME,
                          created=int(time.time()), prompt_tokens=len(prompt_ids), choices=answers)

    def _answers(self, choices: list[dict[str, Any]], params: dict[str, Any], call_format: str | None,
                 with_logprobs: bool) -> list[ChoiceOut]:
        """What the client sees of each engine answer: its text, its tool calls (parsed in `call_format` when
        the request had tools), the finish reason, and the log-probs it asked for."""
        out = []
        for index, choice in enumerate(choices):
            sampled = list(choice.get("token_ids") or [])
            text = reply_text(self.tokenizer, sampled, params.get("stop"))
            content, calls = split_tool_calls(text, call_format) if call_format else (text, [])
            finish = "length" if choice.get("finish_reason") == "length" else ("tool_calls" if calls else "stop")
            stop = choice.get("stop_reason")
            entries = (choice.get("logprobs") or {}).get("content") or []
            answer = ChoiceOut(
                index=index, text=content, finish_reason=finish, completion_tokens=len(sampled),
                tool_calls=[ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", c.name, canonical_arguments(c.arguments))
                            for c in calls],
                stop_string=stop if isinstance(stop, str) else None,
                logprobs=openai_logprobs(self.tokenizer, entries, params["logprobs"]) if with_logprobs else None)
            answer.pieces = text_pieces(self.tokenizer, sampled, content) if not calls else [content] * bool(content)
            out.append(answer)
        return out

    def _record(self, episode: _Episode, session: ChatSession, trajectory, prompt_ids: list[int],
                messages: list[dict[str, Any]], choices: list[dict[str, Any]], answers: list[ChoiceOut]) -> None:
        """Record a finished call, only while its episode is open: close_episode has handed the sessions over.
        With n > 1 each answer extends its own copy of the trajectory: each is a trained sample."""
        with self._guard:
            if not episode.open:
                raise EpisodeClosed
            branches = [trajectory] + [branch(trajectory) for _ in answers[1:]]
            for target, choice, answer in zip(branches, choices, answers):
                sampled = list(choice.get("token_ids") or [])
                content = (choice.get("logprobs") or {}).get("content") or []
                versions = choice.get("weight_versions") or []  # spans over `sampled`
                session.record(target, prompt_ids, messages, sampled, [c["logprob"] for c in content], versions,
                               choice.get("finish_reason") or "stop", answer.chat_message(), self.template)
            episode.sessions.setdefault(session.session_id, session)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def _generate(self, session_id: str, prompt_ids: list[int], params: dict[str, Any],
                        model: str = MODEL_NAME) -> list[dict[str, Any]]:
        """Token-in/token-out through the router, keyed by session, retried like the rollout's requests; one
        choice per answer asked for (n)."""
        payload = {"token_ids": prompt_ids, "sampling_params": params, "model": model}
        try:
            return await request_choices(self._http, self.router_url, payload, timeout=self.timeout,
                                          retries=self.retries, retry_window_s=self.retry_window_s,
                                          headers={SESSION_HEADER: routing_key(session_id)}, counters=self.counters)
        except EngineRejectedError as e:
            raise EngineError(400, str(e)) from e
        except EngineUnavailableError as e:
            raise EngineError(502, str(e)) from e


def _unauthorized(error=None) -> web.Response:
    return (error or _error)(401, "no open episode for this session id: use the session id the harness gave this "
                                  "episode's agent (or it + '/ROLE'), and only until the episode ends",
                             "invalid_api_key")


async def _send_events(request: web.Request, events: list[tuple[str | None, dict[str, Any]]],
                       done_marker: bool = False) -> web.StreamResponse:
    """Server-sent events: `event: NAME` lines where the API names its events (Responses, Anthropic), then
    each event's JSON; OpenAI chat streams end with `data: [DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        await response.write(f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
    if done_marker:
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _error(status: int, message: str, code: str | int | None = None) -> web.Response:
    """An OpenAI-style error body (the openai client raises it as BadRequestError, AuthenticationError, ...)."""
    kind = "invalid_request_error" if status < 500 else "api_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": status if code is None else code}}, status=status)
