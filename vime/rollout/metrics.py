"""Rollout metrics: pure functions of the samples."""

from __future__ import annotations

import statistics

from vime.utils.types import Sample


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def rollout_metrics(samples: list[Sample], args=None, prefix: str = "rollout") -> dict[str, float]:
    """Reward, length, truncation and failure statistics of one rollout's samples."""
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
    failures: dict[str, int] = {}
    for s in samples:
        if s.status == Sample.Status.FAILED:
            stage = s.metadata.get("failure", {}).get("stage", "unknown")
            failures[stage] = failures.get(stage, 0) + 1
    for stage, n in failures.items():
        m[f"{prefix}/failed_{stage}"] = float(n)
    return m
