"""A judge served by the run (`--judge-checkpoint`): its own vLLM engines serving a judge or reward model that
reward functions call through an OpenAI-compatible URL; it never receives weight updates.

The rollout manager starts it beside the policy's engines (`JudgeGroup.launch` / `start`, in its own process, on
loopback) and stops it with them. The judge's engines are not the fleet's, so no weight update, pause or health
restart ever reaches them. Reward functions reach it through the rollout context:

    from vime.environments.judge import run_judge
    judge = run_judge()                      # None when the run serves no judge
    reply = await judge.chat([{"role": "user", "content": "Is 2 + 2 = 4? Answer yes or no."}])
    reply["text"], reply["token_ids"], reply["logprobs"]
    judge.base_url, judge.api_key            # for an OpenAI client of your own (e.g. a verifiers JudgeRubric)

Calls are bounded: at most --judge-concurrency in flight (the engine batches those), each within --judge-timeout
seconds (a timeout raises `JudgeTimeout`, which fails the sample whose reward asked). Metrics: judge/calls,
judge/errors, judge/timeouts, judge/time_s (running totals), judge/prompt_tokens and judge/completion_tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import ray

from vime.config.agents import JudgeConfig
from vime.config.rollout import EnginesConfig
from vime.config.run import JobConfig
from vime.rollout.context import rollout_context
from vime.rollout.metrics import add_counter
from vime.utils.auth import RunToken
from vime.utils.misc import with_values

logger = logging.getLogger(__name__)
JUDGE_MODEL = "policy"  # the name vime's engines serve their model under (the judge's engines are vime engines)


class JudgeTimeout(TimeoutError):
    """A judge call exceeded --judge-timeout."""


def judge_engine_args(args):
    """The flags a judge engine is started with: the run's engine flags (--vllm-*), the judge's checkpoint, one
    device per engine, no LoRA adapters, no routing capture."""
    judge = JudgeConfig.of(args)
    job = JobConfig.of(args)
    return with_values(args, hf_checkpoint=judge.judge_checkpoint, rollout_num_gpus_per_engine=1, lora_sync=None,
                       lora_adapters=None, use_rollout_routing_replay=False, seed=job.seed + 1000)


class JudgeGroup:
    """The judge's engines (`VLLMEngine` actors on the judge's own placement bundles, launched by whoever made
    them: the rollout manager, with `judge_engine_args`) and the client reward functions use. `token`: the run's,
    which its engines were started with."""

    def __init__(self, args, engines: list, token: RunToken):
        self.args = args
        self.engines = engines
        self.token = token
        self.urls: list[str] = []
        self.semaphore: asyncio.Semaphore | None = None
        self._next = 0
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> list[str]:
        """Wait for the engines (launched as their actors were made) to serve; their URLs."""
        engines = EnginesConfig.of(self.args)
        self.urls = ray.get([engine.start.remote() for engine in self.engines],
                            timeout=engines.engine_startup_timeout + 60)
        return self.urls

    @property
    def base_url(self) -> str:
        """An OpenAI-compatible base URL of the judge (its first engine; `chat` spreads calls over all)."""
        return f"{self.urls[0]}/v1"

    @property
    def api_key(self) -> str:
        """The key its generation routes take (the run's serving key, derived from the run's secret)."""
        return self.token.serving_key()

    async def chat(self, messages: list[dict[str, Any]], *, max_tokens: int | None = None,
                   temperature: float | None = None, **extra: Any) -> dict[str, Any]:
        """One chat completion from the judge: {"text", "token_ids", "prompt_token_ids", "logprobs"}. Raises
        `JudgeTimeout` past --judge-timeout, RuntimeError on an engine error."""
        judge = JudgeConfig.of(self.args)
        if self.semaphore is None:  # made on first use, in the event loop that runs the rewards
            self.semaphore = asyncio.Semaphore(judge.judge_concurrency)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        body = {"model": JUDGE_MODEL, "messages": messages, "logprobs": True, "return_token_ids": True,
                "max_tokens": max_tokens or judge.judge_max_tokens,
                "temperature": judge.judge_temperature if temperature is None else temperature, **extra}
        start = time.perf_counter()
        add_counter("judge/calls")
        try:
            async with self.semaphore:
                async with self._session.post(f"{url}/v1/chat/completions", json=body,
                                              headers={"Authorization": f"Bearer {self.api_key}"},
                                              timeout=aiohttp.ClientTimeout(total=judge.judge_timeout)) as r:
                    answer = await r.json(content_type=None)
                    if r.status != 200:
                        raise RuntimeError(f"judge engine {url} answered {r.status}: {str(answer)[:500]}")
        except asyncio.TimeoutError:
            add_counter("judge/timeouts")
            raise JudgeTimeout(f"the judge did not answer within --judge-timeout {judge.judge_timeout}s") from None
        except Exception:
            add_counter("judge/errors")
            raise
        finally:
            add_counter("judge/time_s", time.perf_counter() - start)
        choice = answer["choices"][0]
        usage = answer.get("usage") or {}
        add_counter("judge/prompt_tokens", float(usage.get("prompt_tokens", 0)))
        add_counter("judge/completion_tokens", float(usage.get("completion_tokens", 0)))
        return {"text": choice["message"].get("content") or "", "token_ids": choice.get("token_ids") or [],
                "prompt_token_ids": answer.get("prompt_token_ids") or [],
                "logprobs": [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]}

    def stop(self) -> None:
        stops = [engine.stop.remote() for engine in self.engines]  # all at once: each waits for its server's exit
        for engine, stop in zip(self.engines, stops):
            try:
                ray.get(stop, timeout=60)
            except Exception as err:  # an engine already dead: its actor's watchdog killed the server
                logger.warning("stopping a judge engine: %s", type(err).__name__)
            ray.kill(engine)
        self.engines, self.urls = [], []


def run_judge() -> JudgeGroup | None:
    """This run's judge (in the rollout manager's process), or None without --judge-checkpoint."""
    return rollout_context().judge
