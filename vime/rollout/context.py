"""What rollout code needs from the running system rather than from the flags: where the router listens, which
engines are in service, the run's secret (`RunToken`: generate requests carry its serving key), the run's counters,
and what every generate call of the run shares (the generate state: tokenizer, HTTP session, concurrency limit; the
reward workers; the agents' OpenAI-compatible endpoint).

The rollout manager owns one `RolloutContext` per run, made with the run's token. It fills it in as it starts the
router and the engines (and as the health monitor takes engines out and puts restarted ones back), makes it current
around each of its calls (`use_rollout_context`), and closes what it holds at shutdown. Rollout code, and custom
rollout, generate and reward functions with slime's signatures, reach it through `rollout_context()`: a context
variable, so that it follows a call into the asyncio tasks and threads it starts (`asyncio.to_thread`,
`vime.utils.async_utils.run`), and two runs in one process (tests) never see each other's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vime.utils.auth import RunToken

logger = logging.getLogger(__name__)


@dataclass
class RolloutContext:
    router_url: str | None = None  # "http://host:port" of the router every generate request goes through
    engine_urls: list[str] = field(default_factory=list)  # the engines in service now
    # the run's secret (the rollout manager's); a context made outside a run has one of its own, which no run's
    # engines accept
    token: RunToken = field(default_factory=RunToken.new)
    counters: dict[str, float] = field(default_factory=dict)  # running totals, reported with every rollout
    counters_once: dict[str, float] = field(default_factory=dict)  # reported with the next rollout only
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the health monitor's thread writes
    generate_state: Any = None  # vime.rollout.generation.GenerateState, made by the first generate call
    # the args custom functions receive (vime.utils.plugin_args): the flags and the run-time values, the router's
    # address kept current by the engine fleet
    plugin_args: Any = None
    # --environment: {name: vime.environments.base.Environment}, loaded by the rollout manager; the environment
    # hooks (generate, reward) find each sample's environment here
    environments: dict[str, Any] = field(default_factory=dict)
    judge: Any = None  # --judge-checkpoint: vime.environments.judge.JudgeGroup, started by the rollout manager
    reward_workers: Any = None  # vime.rollout.worker_pool.WorkerPool of pooled rewards (rm_hub.pool), on first use
    agent_server: Any = None  # vime.agents.openai_server.OpenAIServer of agent episodes (agents.harness), on first use

    def add_counter(self, key: str, n: float = 1.0) -> None:
        """Add `n` to a running total (e.g. rollout/engine_restarts); safe from any thread."""
        with self.lock:
            self.counters[key] = self.counters.get(key, 0.0) + n

    def close(self) -> None:
        """Stop what the run's rollouts started in this process (reward workers, the agents' endpoint); the
        context can start them again on next use."""
        with self.lock:
            workers, self.reward_workers = self.reward_workers, None
            server, self.agent_server = self.agent_server, None
        for name, resource, stop in (("reward workers", workers, "close"), ("agents' endpoint", server, "stop")):
            if resource is None:
                continue
            try:
                getattr(resource, stop)()
            except Exception:  # one that fails to stop must not keep the other running
                logger.exception("stopping the %s failed", name)


_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar("vime_rollout_context",
                                                                                  default=None)


def rollout_context() -> RolloutContext:
    """The rollout context of the call in progress. Outside the rollout manager's calls (a script, or slime-style
    code called directly, which expects slime's process-wide state) the first use makes one, current from then on
    in the calling thread's context."""
    context = _current.get()
    if context is None:
        context = RolloutContext()
        _current.set(context)
    return context


def current_rollout_context() -> RolloutContext | None:
    """The rollout context of the call in progress, or None outside a run (code also used on its own)."""
    return _current.get()


@contextlib.contextmanager
def use_rollout_context(context: RolloutContext) -> Iterator[RolloutContext]:
    """Make `context` current for the code inside the block (and the tasks and threads it starts)."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def reset_rollout_context(**fields) -> RolloutContext:
    """A fresh context, current from here on in this thread's context (a script, a test), with `fields` set; the
    one it replaces is closed."""
    previous = _current.get()
    if previous is not None:
        previous.close()
    context = RolloutContext(**fields)
    _current.set(context)
    return context


def in_rollout_context(cls):
    """Class decorator for the context's owner: each public method runs with the instance's `context` current.
    `functools.wraps` keeps the attributes Ray's `@ray.method` sets (concurrency group, ...)."""

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with use_rollout_context(self.context):
                return method(self, *args, **kwargs)

        return call

    for name, value in list(vars(cls).items()):
        if callable(value) and not name.startswith("_") and not isinstance(value, (staticmethod, classmethod)):
            setattr(cls, name, wrap(value))
    return cls
