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
    ref_update_interval: int | None = None
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

    def check(self) -> None:
        """This section's own bounds; the rules that involve the estimator's registry, the effective policy loss
        or other sections are `vime.algorithms.arguments.validate_algorithm_args`'s."""
        if self.eps_clip <= 0:
            raise ValueError(f"--eps-clip must be > 0, got {self.eps_clip}")
        if self.ref_update_interval is not None and self.ref_update_interval < 1:
            raise ValueError(f"--ref-update-interval must be >= 1 rollout, got {self.ref_update_interval}; omit it "
                             "to keep the reference fixed")
        if self.eps_clip_high is not None and self.eps_clip_high <= 0:
            raise ValueError(f"--eps-clip-high must be > 0, got {self.eps_clip_high}; omit it to use --eps-clip")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError(
                f"--eps-clip-c must be > 1.0 (it caps the loss of negative advantages at -A * eps_clip_c), "
                f"got {self.eps_clip_c}; pass a value such as 3.0 or omit the flag to disable dual clip")
        if self.cispo_eps_low is not None and self.cispo_eps_low <= 0:
            raise ValueError(f"--cispo-eps-low must be > 0, got {self.cispo_eps_low}; omit it for no lower bound")
        if self.overlong_buffer_len is None and self.overlong_penalty_factor != 1.0:
            raise ValueError("--overlong-penalty-factor needs --overlong-buffer-len (the buffer the penalty grows over)")
        if self.overlong_buffer_len is not None and self.overlong_penalty_factor < 0:
            raise ValueError(f"--overlong-penalty-factor must be >= 0, got {self.overlong_penalty_factor}")
        if self.entropy_top_fraction is not None and not 0.0 < self.entropy_top_fraction <= 1.0:
            raise ValueError(f"--entropy-top-fraction must lie in (0, 1], got {self.entropy_top_fraction}")


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

    def check(self) -> None:
        if self.tis_clip_low > self.tis_clip:
            raise ValueError(f"--tis-clip-low ({self.tis_clip_low}) must be <= --tis-clip ({self.tis_clip}); "
                             "lower --tis-clip-low or raise --tis-clip")
        if self.use_rollout_logprobs and (self.use_tis or self.use_mis):
            raise ValueError("--use-rollout-logprobs makes the engine's log-probs the old policy, so every TIS / MIS "
                             "weight would be exactly 1: drop --use-tis / --use-mis, or drop --use-rollout-logprobs")
        if self.custom_tis_function_path and not self.use_tis:
            raise ValueError("--custom-tis-function-path replaces the built-in TIS: add --use-tis")
        if self.use_mis and self.use_tis:
            raise ValueError("--use-mis and --use-tis are mutually exclusive (both reweight the policy loss by "
                             "exp(old_logp - rollout_logp)); pass one of them")
        if not 0 <= self.mis_threshold_low < self.mis_threshold_high:
            raise ValueError(f"MIS thresholds must satisfy 0 <= --mis-threshold-low ({self.mis_threshold_low}) < "
                             f"--mis-threshold-high ({self.mis_threshold_high})")


@dataclasses.dataclass(frozen=True)
class DistillationConfig(Section):
    """On-policy distillation from a teacher (`--opd-*`)."""

    opd_teacher_checkpoint: str | None = None
    opd_mode: Literal["reward", "loss"] = "reward"
    opd_coef: float = 1.0
    opd_kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"

    def check(self) -> None:
        if self.opd_teacher_checkpoint is not None and self.opd_coef <= 0:
            raise ValueError(f"--opd-coef must be > 0, got {self.opd_coef}; omit --opd-teacher-checkpoint "
                             "for no distillation")
