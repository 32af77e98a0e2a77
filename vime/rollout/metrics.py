"""Rollout metrics: pure functions of the samples, plus counters kept in the rollout context.

Counters are things no sample shows: engine restarts (the health monitor), malformed prompt rows (the loader),
the peak number of requests in flight (the generate path). `record_counters(..., once=True)` values are reported
with the next rollout only; the others are running totals reported with every rollout.
"""

from __future__ import annotations

import statistics

from vime.rollout.context import rollout_context
from vime.utils.types import Sample


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def record_counters(values: dict[str, float], once: bool = True) -> None:
    """Set counters reported with the next rollout's metrics (`once`) or with every rollout from now on."""
    context = rollout_context()
    with context.lock:
        (context.counters_once if once else context.counters).update(values)


def add_counter(key: str, n: float = 1.0) -> None:
    """Add `n` to a running total (e.g. rollout/engine_restarts)."""
    context = rollout_context()
    with context.lock:
        context.counters[key] = context.counters.get(key, 0.0) + n


def take_counters() -> dict[str, float]:
    """The counters to report now: the running totals and the once-only values (which are then cleared)."""
    context = rollout_context()
    with context.lock:
        out = {**context.counters, **context.counters_once}
        context.counters_once.clear()
    return out


def failure_key(sample: Sample) -> str:
    """`<stage>_<reason>` of a failed sample, e.g. reward_timeout, generate_engine_rejected."""
    failure = sample.metadata.get("failure") or {}
    return f"{failure.get('stage', 'unknown')}_{failure.get('reason', 'error')}"


def rollout_metrics(samples: list[Sample], args=None, prefix: str = "rollout") -> dict[str, float]:
    """Reward, length, truncation and failure statistics of one rollout's samples (failures by stage and reason:
    `<prefix>/failed/<stage>_<reason>`); a training rollout (prefix "rollout") also reports the counters."""
    scored = [s for s in samples if s.status not in (Sample.Status.FAILED, Sample.Status.ABORTED)]
    rewards = [s.get_reward_value(args) for s in scored if s.reward is not None]
    lengths = [s.response_length for s in samples]
    m = {
        f"{prefix}/num_samples": float(len(samples)),
        f"{prefix}/reward_mean": _mean(rewards),
        f"{prefix}/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        f"{prefix}/response_len_mean": _mean(lengths),
        f"{prefix}/response_len_max": float(max(lengths, default=0)),
        f"{prefix}/truncated_ratio": _mean([float(s.status == Sample.Status.TRUNCATED) for s in samples]),
        f"{prefix}/failed_samples": float(sum(s.status == Sample.Status.FAILED for s in samples)),
        f"{prefix}/response_tokens": float(sum(lengths)),
    }
    for s in samples:
        if s.status == Sample.Status.FAILED:
            key = f"{prefix}/failed/{failure_key(s)}"
            m[key] = m.get(key, 0.0) + 1.0
    if prefix == "rollout" and args is not None:
        m.update(take_counters())
    return m
