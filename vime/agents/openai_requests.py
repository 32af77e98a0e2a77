"""A call to the OpenAI-compatible endpoint as it arrives: whose it is (the session id, its episode, the router's
affinity key), its body (read within the size limit, decoded as it comes, parsed off the event loop) and what it
asks the engines for (vLLM sampling params; a seed per session and call).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import zlib
from typing import Any

from aiohttp import web

SESSION_HEADER = "X-Session-ID"
MAX_SESSION_ID_CHARS = 256  # a token (32 hex digits), "/" and a role name
# json.loads holds the GIL (every thread of the rollout process waits) ~1.5 ms per MiB; a text-only policy's
# longest useful request, a full context window, is well under 1 MiB.
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
# A call whose headers carry no session id may name it in the body's `user`: that body is read before anything
# vouches for the caller, so only this much of it (a first call's messages; long conversations use the API key).
ANONYMOUS_MAX_REQUEST_BYTES = 64 * 2**10
# Calls served at once (reading, waiting on the engines, answering); more are answered 503 at once (the openai
# client retries it) rather than each holding a handler and a body.
DEFAULT_MAX_IN_FLIGHT = 1024
MAX_CHOICES = 64  # n: each answer is an engine sequence and a trained sample
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def session_id_of(headers, body: dict[str, Any]) -> str | None:
    if headers.get(SESSION_HEADER):
        return headers[SESSION_HEADER]
    key = api_key_of(headers)
    if key:
        return key
    user = body.get("user")
    return str(user) if user else None


def api_key_of(headers) -> str | None:
    """The API key a call carries: `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key` (Anthropic's)."""
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    return headers.get("x-api-key") or None


def episode_of(session_id: str) -> str:
    return session_id.split("/", 1)[0]


def token_key(token: str) -> bytes:
    """What an episode is filed under: the token's SHA-256. Lookups then compare digests, never the token itself,
    so their timing says nothing about how much of a guessed token is right."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def public_id(token: str) -> str:
    """An episode's name that is no credential: the digest it is filed under (`token_key`), in hex. What a relay
    may write where others can read it (`OpenAIServer.relay_key`)."""
    return token_key(token).hex()


def filed_under(public: str) -> bytes | None:
    """The digest (`token_key`) an episode's public id names; None for what is no public id."""
    try:
        return bytes.fromhex(public)
    except ValueError:
        return None


def routing_key(session_id: str) -> str:
    """The router's affinity key for a session: stable per session, and no use as a credential."""
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class BodyTooLarge(Exception):
    pass


class CallSlots:
    """Calls served at once, up to `limit` (`take` is False beyond it). Used on the server's event loop only."""

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError(f"max_in_flight is {limit}; give a positive number of calls served at once")
        self.limit, self.taken = int(limit), 0

    def take(self) -> bool:
        if self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def give_back(self) -> None:
        self.taken -= 1


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
