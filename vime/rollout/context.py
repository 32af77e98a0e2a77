"""What rollout code needs from the running system rather than from the flags: where the router listens, which
engines are in service, the run's counters, and the generate state (tokenizer, HTTP session, concurrency limit)
that every generate call of the run shares.

One per process, owned by the rollout manager (it fills the context in as it starts the router and the engines,
and as the health monitor takes engines out and puts restarted ones back) and read by rollout code through
`rollout_context()`. Custom rollout, generate and reward functions keep slime's signatures and reach it the
same way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RolloutContext:
    router_url: str | None = None  # "http://host:port" of the router every generate request goes through
    engine_urls: list[str] = field(default_factory=list)  # the engines in service now
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


_context = RolloutContext()


def rollout_context() -> RolloutContext:
    """This process's rollout context."""
    return _context


def reset_rollout_context(**fields) -> RolloutContext:
    """A fresh context for this process (a new run in it, or a test), with `fields` set."""
    global _context
    _context = RolloutContext(**fields)
    return _context
