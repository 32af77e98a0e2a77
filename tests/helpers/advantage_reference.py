"""Hand-computed references for the advantage statistics a trainer reports (train/advantage_mean, _std), from a
saved rollout alone, in plain Python (no vime math): what an e2e run's metrics must equal."""

from __future__ import annotations

import math

import pytest


def _token_stats(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def grpo_token_stats(groups, eps: float = 1e-6) -> tuple[float, float]:
    """grpo / gspo / cispo: A = (r - mean(group)) / (unbiased std(group) + eps) on each trainable token of the
    sample; the mean and population std of A over every trainable token of the batch."""
    values = []
    for group in groups:
        members = [s for s in group if sum(s.loss_mask or []) > 0]
        rewards = [s.reward for s in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        values += [(s.reward - mean) / (std + eps) for s in members for m in s.loss_mask if m]
    return _token_stats(values)


def on_policy_grpo_pg_loss(groups, eps: float = 1e-6) -> float:
    """One optimizer step on the rollout's own weights, token-mean aggregation: every ratio is 1 and nothing is
    clipped, so the policy loss is -sum_i A_i * T_i / sum_i T_i (T_i: sample i's trainable tokens)."""
    total, tokens = 0.0, 0
    for group in groups:
        members = [s for s in group if sum(s.loss_mask or []) > 0]
        rewards = [s.reward for s in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        for s in members:
            total -= (s.reward - mean) / (std + eps) * sum(s.loss_mask)
            tokens += sum(s.loss_mask)
    return total / tokens


def check_grpo_stats(record: dict, groups) -> None:
    mean, std = grpo_token_stats(groups)
    assert record["train/advantage_mean"] == pytest.approx(mean, abs=1e-5), record
    assert record["train/advantage_std"] == pytest.approx(std, abs=1e-5), record


def check_whitened(record: dict) -> None:
    """reinforce_plus_plus(_baseline): advantages whitened over the batch's trainable tokens."""
    assert abs(record["train/advantage_mean"]) < 1e-5, record
    assert record["train/advantage_std"] == pytest.approx(1.0, abs=1e-4), record
