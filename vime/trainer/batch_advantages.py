"""One rollout's advantages (and returns) on a training rank: the run's estimator (`vime.algorithms`, or
--custom-advantage-function-path) applied to the batch after the reward shaping the flags ask for.

Every rank holds the whole batch, so every rank computes the same advantages. With --lora-adapters each adapter's
samples are estimated apart.
"""

from __future__ import annotations

import torch

from vime.algorithms import compute_approx_kl, get_advantage_estimator
from vime.algorithms.distillation import opd_token_rewards
from vime.algorithms.shaping import overlong_penalties
from vime.config.algorithm import AlgorithmConfig
from vime.config.rollout import RolloutConfig
from vime.trainer.train_batch import TrainBatch
from vime.utils.misc import load_function

# estimators that need per-token log-probs (KL in the reward) rather than rewards alone
PER_TOKEN_ESTIMATORS = {"reinforce_plus_plus", "ppo"}


def compute_advantages(args, batch: TrainBatch) -> dict[str, float]:
    """The estimator's advantages (and returns) into `batch`; returns the shaping's own metrics: the overlong
    penalties applied (--overlong-buffer-len) and the ReMax baselines (--advantage-estimator remax)."""
    algorithm = AlgorithmConfig.of(args)
    rollout = RolloutConfig.of(args)
    n = len(batch.tokens)
    metrics: dict[str, float] = {}
    rewards = batch.rewards
    usable = torch.tensor([bool(m.any()) for m in batch.loss_masks])
    n_usable = max(1, int(usable.sum()))
    if algorithm.overlong_buffer_len is not None:  # DAPO's soft overlong punishment, added to the reward
        penalties = torch.tensor(overlong_penalties(batch.response_lengths, rollout.rollout_max_response_len,
                                                    algorithm.overlong_buffer_len, algorithm.overlong_penalty_factor))
        penalties = torch.where(usable, penalties, torch.zeros_like(penalties))
        rewards = rewards + penalties
        metrics["train/overlong_penalty_mean"] = float(penalties.sum()) / n_usable
        metrics["train/overlong_penalized_fraction"] = float((penalties < 0).sum()) / n_usable
    extra = {}
    if algorithm.advantage_estimator == "remax" and not algorithm.custom_advantage_function_path:
        if batch.greedy_rewards is None:
            raise ValueError("--advantage-estimator remax: no sample carries its greedy baseline reward "
                             "(metadata['remax_greedy_reward']); the default rollout writes it, a custom rollout "
                             "must too")
        extra["greedy_rewards"] = batch.greedy_rewards
        baselines = batch.greedy_rewards[usable & torch.isfinite(batch.greedy_rewards)]
        metrics["train/remax_greedy_reward_mean"] = float(baselines.mean()) if len(baselines) else 0.0
    if algorithm.custom_advantage_function_path:
        estimator = load_function(algorithm.custom_advantage_function_path)
    else:
        estimator = get_advantage_estimator(algorithm.advantage_estimator)
    kl = None
    group_size = rollout.n_samples_per_prompt
    if algorithm.kl_coef and algorithm.advantage_estimator in PER_TOKEN_ESTIMATORS and batch.ref_log_probs is not None:
        kl = [compute_approx_kl(o, r, algorithm.kl_loss_type) if o is not None and r is not None
              else torch.zeros(batch.response_lengths[i])
              for i, (o, r) in enumerate(zip(batch.old_log_probs, batch.ref_log_probs))]

    def estimate(rows: list[int]):
        def pick(values):
            return None if values is None else [values[i] for i in rows]

        return estimator(
            rewards=rewards[rows], loss_masks=pick(batch.loss_masks), n_samples_per_prompt=group_size,
            kl=pick(kl), values=pick(batch.values), kl_coef=algorithm.kl_coef, gamma=algorithm.gamma,
            lambd=algorithm.lambd,
            normalize_std=not algorithm.disable_grpo_std_normalization,
            normalize_advantages=algorithm.normalize_advantages, eps=algorithm.advantage_eps,
            **{k: v[rows] for k, v in extra.items()})

    # multi-LoRA: each adapter's advantages from its own samples only (a batch-wide baseline or whitening
    # would mix two tasks' reward scales); its groups stay whole, as the data source hands out whole groups
    parts = [list(range(n))] if batch.adapters is None else \
        [[i for i, a in enumerate(batch.adapters) if a == k] for k in sorted(set(batch.adapters))]
    batch.advantages, batch.returns = [None] * n, [None] * n
    for rows in parts:
        advantages, returns = estimate(rows)
        for i, a, r in zip(rows, advantages, returns):
            batch.advantages[i], batch.returns[i] = a, r
    assert all(a is not None for a in batch.advantages)
    return metrics


def add_opd_rewards(batch: TrainBatch, opd_coef: float) -> None:
    """--opd-mode reward: each of this rank's samples gets the teacher's per-token reward on top of its
    advantages (the teacher scored only this rank's samples; the others are not trained here)."""
    local = [i for i, teacher in enumerate(batch.teacher_log_probs) if teacher is not None]
    rewards = opd_token_rewards([batch.sampling_log_probs(i) for i in local],
                                [batch.teacher_log_probs[i] for i in local],
                                [batch.loss_masks[i] for i in local], opd_coef)
    for i, reward in zip(local, rewards):
        batch.advantages[i] = batch.advantages[i] + reward
