"""`--rm-type remote_rm`: ask a reward server over HTTP.

POSTs `{"prompt", "response", "label", "metadata"}` as JSON to `--rm-url`. The server answers with a number,
`{"reward": number}`, or a dict of several fields (returned as-is; pick one with `--reward-key`).
Failures are retried `--rm-max-retries` times with exponential backoff. All attempts share one deadline,
`--rm-timeout` from the first: each attempt gets the time left split evenly over the attempts left (or
`--rm-attempt-timeout`, if smaller), so a server that hangs once still leaves time for a retry.
A NaN or infinite reward (Python's JSON parser accepts them) raises `NonFiniteRewardError`; it is not retried.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx

from vime.config.rollout import RewardConfig
from .registry import register_rm

BACKOFF_BASE_S = 0.5  # waits 0.5 s, 1 s, 2 s, ... between attempts (never past the deadline)


class NonFiniteRewardError(ValueError):
    """The reward server answered NaN or +-Infinity; the sample fails instead of training on it."""


def _check_finite(url: str, value, field: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise NonFiniteRewardError(f"reward server {url} returned a non-finite {field} {value!r}; fix the server "
                                   "(this sample is marked failed)")


def _parse_reward(url: str, body) -> float | dict:
    if isinstance(body, (int, float)) and not isinstance(body, bool):
        _check_finite(url, float(body), "reward")
        return float(body)
    if isinstance(body, dict) and body:
        for key, value in body.items():
            _check_finite(url, value, f"value of {key!r}")
        return float(body["reward"]) if set(body) == {"reward"} else body
    raise ValueError(f"reward server {url} returned {body!r}; expected a number or a JSON object")


@register_rm("remote_rm", needs_label=False)
async def remote_rm(args, sample) -> float | dict:
    rewards = RewardConfig.of(args)
    url = rewards.rm_url
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url")
    attempts = 1 + rewards.rm_max_retries
    timeout = rewards.rm_timeout or RewardConfig().rm_timeout  # an explicit None: the flag's default
    attempt_cap = rewards.rm_attempt_timeout or timeout
    deadline = time.monotonic() + timeout
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label, "metadata": sample.metadata}
    last_error: Exception | None = None
    tried = 0
    async with httpx.AsyncClient(timeout=None) as client:  # each attempt is bounded by wait_for below
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(min(BACKOFF_BASE_S * 2 ** (attempt - 1), max(0.0, deadline - time.monotonic())))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            tried += 1
            try:
                response = await asyncio.wait_for(client.post(url, json=payload),
                                                  min(attempt_cap, left / (attempts - attempt)))
                response.raise_for_status()
                body = response.json()
            except (httpx.HTTPError, ValueError, TimeoutError) as e:  # ValueError: the body is not JSON
                last_error = e
                continue
            return _parse_reward(url, body)
    raise RuntimeError(f"reward server {url} failed {tried} times within --rm-timeout {timeout:g}s "
                       f"(sample {sample.index}); last error: {last_error!r}")
