"""One token-in/token-out generate request through vllm-router, with retries.

Both the default rollout (`vime.rollout.generation.post_generate`) and the OpenAI-compatible endpoint
(`vime.agents.openai_server`) send their requests through `request_generate`, so both retry the same errors for
as long: connection errors, timeouts, 5xx and 429 (overloaded) are retried at least `retries` times and for at
least `retry_window_s` (what fault tolerance needs to outlast a dead engine); any other 4xx is the request's own
fault and raises `EngineRejectedError` at once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import logging
import time
from typing import Any

import aiohttp
import numpy as np

from vime.utils.auth import RunToken

logger = logging.getLogger(__name__)

GENERATE_ROUTE = "/inference/v1/generate"


class EngineRejectedError(ValueError):
    """The engine answered 4xx: the request itself is bad (e.g. prompt + max_tokens over --max-model-len)."""


class EngineUnavailableError(RuntimeError):
    """No engine answered the request within the retry budget."""


class RequestCounters:
    """In-flight and retry counts across requests (the rollout's `GenerateState` carries the same three)."""

    def __init__(self):
        self.in_flight = 0
        self.max_in_flight = 0
        self.retries = 0


def error_message(text: str) -> str:
    """The `error` field of an engine's JSON error answer, else the text (cut to 500 characters)."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:500]
    return str(body.get("error", body) if isinstance(body, dict) else body)[:500]


def tokens_only(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` asking the engine not to detokenize (vLLM's `detokenize: false`): every caller here decodes the
    tokens itself, and the engine's incremental detokenizer runs in its server process, which shares the CPUs
    with the generation it serves. Stop strings are matched on the engine's text, so a request with `stop`
    (or its own `detokenize`) is left as it is."""
    params = payload.get("sampling_params") or {}
    if params.get("stop") or "detokenize" in params:
        return payload
    return {**payload, "sampling_params": {**params, "detokenize": False}}


async def request_generate(http: aiohttp.ClientSession, router_url: str, payload: dict[str, Any],
                           **kwargs) -> dict[str, Any]:
    """POST `payload` to the router's generate route; returns the answer's first choice (`request_choices`)."""
    return (await request_choices(http, router_url, payload, **kwargs))[0]


async def request_choices(http: aiohttp.ClientSession, router_url: str, payload: dict[str, Any], *,
                          token: RunToken, timeout: aiohttp.ClientTimeout, retries: int, retry_window_s: float = 0.0,
                          headers: dict[str, str] | None = None,
                          counters: RequestCounters | None = None) -> list[dict[str, Any]]:
    """POST `payload` to the router's generate route; returns the answer's choices, one per sequence asked for
    (`sampling_params.n`, which also counts as that many requests in flight). The request carries the serving
    key of the caller's `token` (never the control token: the router sees it), which the router passes on to the
    engine (`vime.utils.auth`)."""
    counters = counters if counters is not None else RequestCounters()
    payload = tokens_only(payload)
    sequences = int(payload.get("sampling_params", {}).get("n") or 1)
    url = router_url.rstrip("/") + GENERATE_ROUTE
    deadline = time.monotonic() + retry_window_s
    last_error: Exception | None = None
    attempt = 0
    while True:
        try:
            counters.in_flight += sequences
            counters.max_in_flight = max(counters.max_in_flight, counters.in_flight)
            async with http.post(url, json=payload, headers={**token.serving_headers(), **(headers or {})},
                                 timeout=timeout) as r:
                text = await r.text()
                if r.status >= 400:
                    message = error_message(text)
                    if r.status < 500 and r.status != 429:  # the request itself is bad: no retry
                        raise EngineRejectedError(f"engine rejected the request (HTTP {r.status}): {message}")
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status, message=message)
                choices = json.loads(text)["choices"]
                if len(choices) != sequences:
                    raise EngineRejectedError(f"asked for {sequences} sequences, the engine answered {len(choices)}")
                return sorted(choices, key=lambda c: c.get("index", 0))
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            last_error = e
            logger.info("generate request failed (attempt %d): %r", attempt + 1, e)
        finally:
            counters.in_flight -= sequences
        attempt += 1
        if attempt > retries and time.monotonic() >= deadline:
            break
        counters.retries += 1
        await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
    raise EngineUnavailableError(f"generate through {router_url} failed after {attempt} attempts: {last_error!r}")


def decode_routed_experts(encoded: str) -> np.ndarray:
    """A generate choice's `routed_experts` (base64 of a `.npy`, as vLLM writes it) -> [tokens - 1, layers,
    top-k] expert ids: the routing of every token the engine forwarded (prompt and response; the last sampled
    token never is). Read without pickle; anything else raises ValueError."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as e:
        raise ValueError(f"routed_experts is not a base64 .npy array: {e}") from e
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(f"routed_experts must be a [tokens, layers, top-k] integer array, got {array.dtype} "
                         f"{array.shape}")
    return array
