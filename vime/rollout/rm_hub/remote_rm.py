"""`--rm-type remote_rm`: ask a reward server over HTTP.

POSTs `{"prompt", "response", "label", "metadata"}` as JSON to `--rm-url`. The server answers with a number,
`{"reward": number}`, or a dict of several fields (returned as-is; pick one with `--reward-key`).
Failures are retried `--rm-max-retries` times with exponential backoff; each request times out after
`--rm-timeout` seconds.
"""

from __future__ import annotations

import asyncio

import httpx

from .registry import register_rm

BACKOFF_BASE_S = 0.5  # waits 0.5 s, 1 s, 2 s, ... between attempts
MAX_RETRIES = 3  # the defaults of --rm-max-retries and --rm-timeout
TIMEOUT_S = 60.0


def _parse_reward(url: str, body) -> float | dict:
    if isinstance(body, (int, float)) and not isinstance(body, bool):
        return float(body)
    if isinstance(body, dict) and body:
        return float(body["reward"]) if set(body) == {"reward"} else body
    raise ValueError(f"reward server {url} returned {body!r}; expected a number or a JSON object")


@register_rm("remote_rm", needs_label=False)
async def remote_rm(args, sample) -> float | dict:
    url = getattr(args, "rm_url", None)
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url")
    attempts = 1 + getattr(args, "rm_max_retries", MAX_RETRIES)
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label, "metadata": sample.metadata}
    last_error: Exception | None = None
    async with httpx.AsyncClient(timeout=getattr(args, "rm_timeout", TIMEOUT_S)) as client:
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(BACKOFF_BASE_S * 2 ** (attempt - 1))
            try:
                response = await client.post(url, json=payload)
                response.raise_for_status()
                body = response.json()
            except (httpx.HTTPError, ValueError) as e:  # ValueError: the body is not JSON
                last_error = e
                continue
            return _parse_reward(url, body)
    raise RuntimeError(
        f"reward server {url} failed {attempts} times (sample {sample.index}); last error: {last_error!r}"
    )
