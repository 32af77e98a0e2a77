"""An OpenAI-compatible chat endpoint in front of the policy: "string in, tokens out".

An existing agent harness points the `openai` client at it and chats; vime records, per session, the exact
token ids the engines saw and sampled, the loss mask, log-probs and weight versions (`chat_session.py`). What a call
brings (session id, body, sampling) is read in `openai_requests.py`; what it gets back is made in `openai_replies.py`.

    server = OpenAIServer(router_url, tokenizer, run_token).start()  # -> "http://127.0.0.1:PORT/v1"
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
flight when its episode closes is answered 401 too and leaves no state behind. The headers' credential is checked
before the body is read (ANONYMOUS_MAX_REQUEST_BYTES of it without one); 503 beyond `max_in_flight` calls. An
episode's sessions and locks live in its `_Episode`, dropped on close, so memory follows the open episodes only.

Each call goes token-in/token-out to `/inference/v1/generate` through vllm-router (`request_choices`, retried
like the rollout's own requests, with the serving key of the run's `RunToken`) with the header
`X-Session-ID: <routing key>`, a digest of the session id (the router never sees the episode's token).
vllm-router 0.1.17's `consistent_hash` policy hashes that header first (then X-User-ID, ..., the body's
session_params.session_id / user, else the whole body), so with
`--router-policy consistent_hash` every call of a session reaches the same engine and reuses its prefix cache.

The server runs on its own event loop in a daemon thread, so a harness may use the sync or the async client
from any thread of the rollout process. That loop only moves bytes: JSON parsing, template rendering,
tokenization and detokenization run in a thread pool (the tokenizer releases the GIL), so /health and other
sessions stay responsive while a large request is prepared. Bodies over `max_request_bytes` (16 MiB by default,
--agent-endpoint-max-request-mb) get 413: json.loads holds the GIL for the whole body (~90 ms at 60 MiB).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from vime.agents.api import anthropic_api, chat_api, responses_api
from vime.agents.api.completion import ChoiceOut, Completion
from vime.agents.chat_session import ChatSession, ChatTemplate, branch
from vime.agents.openai_replies import (client_answers, error_response, no_session_id, send_events, too_large,
                                        unauthorized, within_slots)
from vime.agents.openai_requests import (ANONYMOUS_MAX_REQUEST_BYTES, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_REQUEST_BYTES,
                                         MAX_SESSION_ID_CHARS, SESSION_HEADER, BodyTooLarge, CallSlots, api_key_of,
                                         call_seed, engine_sampling_params, episode_of, filed_under, parse_body,
                                         read_text, routing_key, session_id_of, token_key)
from vime.agents.tool_parsing import forced_call_schema
from vime.engine.control.client import SERVED_MODEL
from vime.engine.control.generate_request import (EngineRejectedError, EngineUnavailableError, RequestCounters,
                                                       request_choices)
from vime.utils.auth import RunToken

logger = logging.getLogger(__name__)
MODEL_NAME = SERVED_MODEL


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

    token: str  # its credential, which its sessions are named after ("TOKEN" or "TOKEN/ROLE")
    forced: dict[str, Any]
    model: str = MODEL_NAME  # a multi-LoRA run's episode: its sample's adapter, whatever model the agent names
    relay: bytes | None = None  # token_key of the one relay key that may name it by public id (`bind_relay`)
    sessions: dict[str, ChatSession] = field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # Responses API: response id -> its conversation in chat form (request messages + answer), for the
    # episode's calls that continue it by previous_response_id.
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    open: bool = True


class OpenAIServer:
    def __init__(self, router_url: str, tokenizer, run_token: RunToken, template_kwargs: dict | None = None,
                 default_sampling: dict[str, Any] | None = None, host: str = "127.0.0.1", port: int = 0,
                 request_timeout_s: float = 600.0, retries: int = 2, retry_window_s: float = 0.0,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, prepare_threads: int = 4,
                 tool_call_format: str = "auto", max_in_flight: int = DEFAULT_MAX_IN_FLIGHT):
        self.router_url = router_url.rstrip("/")
        self.run_token = run_token  # the run's secret: generate requests carry its serving key
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
        self.slots = CallSlots(max_in_flight)  # the calls being served
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
            self.episodes[token_key(token)] = _Episode(token, dict(forced_sampling or {}), model)
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

    def relay_key(self) -> str:
        """A key for a relay that names sessions by their public id (`public_id(token)`, "/ROLE" after it) in the
        X-Session-ID header and proves itself with this key as its API key: a harness that writes the session id
        where others can read it (a command line) then gives away nothing. It opens only the episodes bound to it
        (`bind_relay`): a relay's key, leaked, reaches no other relay's episodes."""
        return secrets.token_hex(16)

    def bind_relay(self, token: str, key: str) -> None:
        """Let the relay holding `key` (`relay_key`) name open episode `token` by its public id; no other key can."""
        with self._guard:
            self.episodes[token_key(token)].relay = token_key(key)  # KeyError: not open (closed, or never opened)

    def _session_of(self, headers) -> str | None:
        """The call's session id (`session_id_of`), or, from a relay, the session its public id names when that
        episode is bound to the relay's key (else the public id itself: refused like any unknown id)."""
        named, key = headers.get(SESSION_HEADER) or "", api_key_of(headers)
        public, sep, role = named.partition("/")
        with self._guard:
            episode = self.episodes.get(filed_under(public))
        if episode is not None and key and episode.relay == token_key(key):  # digests: timing tells nothing
            return episode.token + sep + role
        return session_id_of(headers, {})

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
            return await send_events(request, [(None, c) for c in chunks], done_marker=True)

        return await self._route(request, run, error_response)

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
                return await send_events(request, responses_api.stream_events(completion, body))
            return web.json_response(responses_api.response_object(completion, body))

        return await self._route(request, run, error_response)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API: translated into a chat call."""
        async def run(episode, session_id, body):
            chat_body = await self._off_loop(anthropic_api.chat_request, body)
            completion = await self._call(episode, session_id, chat_body, id_prefix="msg_")
            if body.get("stream"):
                return await send_events(request, anthropic_api.stream_events(completion))
            return web.json_response(anthropic_api.message_object(completion))

        def error(status: int, message: str, code: str | int | None = None) -> web.Response:
            return web.json_response(anthropic_api.error_body(status, message), status=status)

        return await self._route(request, run, error)

    @within_slots
    async def _route(self, request: web.Request, run, error) -> web.StreamResponse:
        """What every API route does around its own part (`run(episode, session_id, body)`): at most
        `max_in_flight` calls at once, the session id and its open episode, the body within its size limit, one
        call at a time per session, and errors in the route's own shape (`error(status, message, code)`)."""
        session_id = self._session_of(request.headers)
        if session_id is not None and self._episode(session_id) is None:
            return unauthorized(error)  # before reading a body that would not be served
        limit = self.max_request_bytes if session_id is not None else ANONYMOUS_MAX_REQUEST_BYTES
        try:
            body = await self._off_loop(parse_body, await read_text(request, limit))
        except BodyTooLarge:
            return too_large(error, limit) if session_id is not None else no_session_id(error, unread_over=limit)
        except ValueError as e:
            return error(400, str(e))
        session_id = session_id or session_id_of({}, body)
        if not session_id:
            return no_session_id(error)
        if len(session_id) > MAX_SESSION_ID_CHARS:
            return error(400, f"the session id is {len(session_id)} characters, over {MAX_SESSION_ID_CHARS}; "
                              "use the episode's token with a short role name, TOKEN/ROLE")
        episode = self._episode(session_id)
        if episode is None:
            return unauthorized(error)
        with self._guard:
            if not episode.open:  # closed since the lookup: a lock now would outlive it
                return unauthorized(error)
            lock = episode.locks.setdefault(session_id, asyncio.Lock())
        async with lock:  # one call at a time per session: each call extends the previous one
            try:
                return await run(episode, session_id, body)
            except EpisodeClosed:
                return unauthorized(error)
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
        answers = await self._off_loop(client_answers, self.tokenizer, choices, params, call_format,
                                      bool(body.get("logprobs")))
        await self._off_loop(self._record, episode, session, trajectory, prompt_ids, messages, choices, answers)
        return Completion(id=f"{id_prefix}{uuid.uuid4().hex}", model=body.get("model") or MODEL_NAME,
                          created=int(time.time()), prompt_tokens=len(prompt_ids), choices=answers)

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
            return await request_choices(self._http, self.router_url, payload, token=self.run_token,
                                          timeout=self.timeout, retries=self.retries,
                                          retry_window_s=self.retry_window_s,
                                          headers={SESSION_HEADER: routing_key(session_id)}, counters=self.counters)
        except EngineRejectedError as e:
            raise EngineError(400, str(e)) from e
        except EngineUnavailableError as e:
            raise EngineError(502, str(e)) from e
