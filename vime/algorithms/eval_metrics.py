"""Evaluation as papers report it, over n samples per eval prompt: pass@k (the unbiased estimator of Chen et al.
2021, "Evaluating Large Language Models Trained on Code"), mean@k and maj@k. Plain Python (no torch): the rollout
manager computes them. A sample is correct when its reward is > 0 (a 0/1 or -1/1 verifier's answer)."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb
from typing import Hashable


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c of them correct, is correct)
    = 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_at_k(rewards: Sequence[float], k: int) -> float:
    """The mean reward of the prompt's first k samples."""
    return sum(rewards[:k]) / k


def maj_at_k(answers: Sequence[Hashable], rewards: Sequence[float], k: int) -> float:
    """1.0 if the most frequent answer among the first k samples is correct, else 0.0; a tie goes to the answer
    seen first, and the answer's correctness is that of its first sample."""
    answers, rewards = list(answers[:k]), list(rewards[:k])
    counts: dict[Hashable, int] = {}
    for a in answers:
        counts[a] = counts.get(a, 0) + 1
    best = max(counts.values())
    winner = next(a for a in answers if counts[a] == best)
    return float(rewards[answers.index(winner)] > 0)


def eval_at_k_metrics(prompts: Sequence[tuple[Sequence[Hashable], Sequence[float]]], ks: Sequence[int]
                      ) -> dict[str, float]:
    """{"pass@k", "mean@k", "maj@k"} for each k, each the mean over prompts; a prompt is (answers, rewards) of its
    n samples in order (n >= k)."""
    out: dict[str, float] = {}
    if not prompts:
        return out
    for k in ks:
        short = [len(r) for _, r in prompts if len(r) < k]
        if short:
            raise ValueError(f"@{k} needs at least {k} samples per eval prompt; a prompt has {short[0]}")
        out[f"pass@{k}"] = sum(pass_at_k(len(r), sum(x > 0 for x in r), k) for _, r in prompts) / len(prompts)
        out[f"mean@{k}"] = sum(mean_at_k(r, k) for _, r in prompts) / len(prompts)
        out[f"maj@{k}"] = sum(maj_at_k(a, r, k) for a, r in prompts) / len(prompts)
    return out
