"""Sections of the RL algorithm: advantages and losses, rollout correction, on-policy distillation."""

from __future__ import annotations

import dataclasses
from typing import Literal

from vime.config.section import Section, derived


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig(Section):
    """The RL algorithm: advantages, losses, KL, entropy (`--advantage-estimator`, `--policy-loss`, ...)."""

    advantage_estimator: str = "grpo"  # a name of vime.algorithms' registry (the flag's choices)
    custom_advantage_function_path: str | None = None
    disable_grpo_std_normalization: bool = False
    advantage_eps: float = 1e-06
    gamma: float = 1.0
    lambd: float = 1.0
    normalize_advantages: bool = False
    loss_type: Literal["policy_loss", "sft_loss", "value_loss"] = "policy_loss"
    policy_loss: str = "ppo"  # a name of vime.algorithms' registry (the flag's choices)
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0
    custom_loss_function_path: str | None = None
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    cispo_eps_low: float | None = None
    value_clip: float = 0.2
    kl_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    entropy_coef: float = 0.0
    entropy_coef_schedule: Literal["constant", "linear", "cosine"] = "constant"
    entropy_coef_final: float = 0.0
    entropy_coef_decay_rollouts: int | None = None
    entropy_top_fraction: float | None = None
    overlong_buffer_len: int | None = None
    overlong_penalty_factor: float = 1.0
    mask_truncated_samples: bool = False
    use_critic: bool = derived(False)  # PPO trains a critic: set by validation from --advantage-estimator
    loss_agg_mode: str = "token_mean"  # one of vime.algorithms' LOSS_AGG_MODES (the flag's choices)


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig(Section):
    """Importance sampling between rollout and trainer policies (`--use-tis`, `--use-mis`, ...)."""

    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_level: Literal["token", "sequence", "geometric"] = "token"
    custom_tis_function_path: str | None = None
    use_mis: bool = False
    mis_level: Literal["token", "sequence", "geometric"] = "token"
    mis_threshold_low: float = 0.5
    mis_threshold_high: float = 2.0
    use_rollout_logprobs: bool = False


@dataclasses.dataclass(frozen=True)
class DistillationConfig(Section):
    """On-policy distillation from a teacher (`--opd-*`)."""

    opd_teacher_checkpoint: str | None = None
    opd_mode: Literal["reward", "loss"] = "reward"
    opd_coef: float = 1.0
    opd_kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
