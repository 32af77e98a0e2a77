"""Sections of the RL algorithm: advantages and losses, rollout correction, on-policy distillation."""

from __future__ import annotations

import dataclasses
from typing import Literal

from vime.config.section import Section, derived, flag

# The names the estimator / loss / aggregation flags accept: the registries in
# vime/algorithms/advantages.py and losses.py hold exactly these built-in names (tests/unit/test_algorithm_names.py).
ADVANTAGE_ESTIMATOR_NAMES = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
                             "rloo", "remax")
POLICY_LOSS_NAMES = ("ppo", "gspo", "cispo", "clip_cov", "kl_cov")
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "bnpo", "dapo")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig(Section):
    """The RL algorithm: advantages, losses, KL, entropy (`--advantage-estimator`, `--policy-loss`, ...)."""

    advantage_estimator: str = flag(
        "grpo", "How per-token advantages are computed from rewards; ppo trains a critic (GAE); rloo: leave-one-out "
        "group baseline; remax: a greedy response per prompt as the baseline (the rollout adds one temperature-0 "
        "request per group). Default: %(default)s.", choices=ADVANTAGE_ESTIMATOR_NAMES)
    custom_advantage_function_path: str | None = flag(
        None, "'pkg.module.function' replacing the estimator; called with the same keywords as the registered "
        "estimators (see vime/algorithms/advantages.py). Default: %(default)s.")
    disable_grpo_std_normalization: bool = flag(
        False, "grpo/gspo/cispo: use r - mean(group) without dividing by the group std (Dr. GRPO). Default: off.")
    advantage_eps: float = flag(1e-06, "Added to the std in grpo normalisation and to the variance in whitening. "
                                "Default: 1e-6.")
    gamma: float = flag(1.0, "Discount per trainable token (reinforce_plus_plus, ppo). Default: %(default)s.")
    lambd: float = flag(1.0, "GAE lambda (ppo). Default: %(default)s.")
    normalize_advantages: bool = flag(False, "ppo: whiten GAE advantages over the batch's trainable tokens "
                                      "(reinforce_plus_plus* always whiten). Default: off.")
    loss_type: Literal["policy_loss", "sft_loss", "value_loss"] = flag(
        "policy_loss", "What the training step minimises; sft_loss is supervised fine-tuning on the loss-masked "
        "tokens. Default: %(default)s.")
    policy_loss: str = flag(
        "ppo", "Token-level (ppo) or sequence-level (gspo) ratio in the clipped surrogate, or cispo's clipped, "
        "detached IS weight on -A * log-prob; forced to gspo / cispo by --advantage-estimator gspo / cispo. "
        "clip_cov / kl_cov: PPO against entropy collapse (Cui et al. 2025, verl), cutting the gradient of / "
        "adding a KL penalty to the tokens of highest advantage-log-prob covariance. Default: %(default)s.",
        choices=POLICY_LOSS_NAMES)
    clip_cov_ratio: float = flag(0.0002, "clip_cov: fraction of the trainable tokens whose gradient is cut. "
                                 "Default: %(default)s.")
    clip_cov_lb: float = flag(1.0, "clip_cov: only tokens of covariance above this are cut. Default: %(default)s.")
    clip_cov_ub: float = flag(5.0, "clip_cov: only tokens of covariance below this are cut. Default: %(default)s.")
    kl_cov_ratio: float = flag(0.0002, "kl_cov: fraction of the trainable tokens (largest covariance) given the KL "
                               "penalty. Default: %(default)s.")
    ppo_kl_coef: float = flag(1.0, "kl_cov: weight of |logp - old_logp| on the penalised tokens. "
                              "Default: %(default)s.")
    custom_loss_function_path: str | None = flag(None, "'pkg.module.function' replacing the whole training loss. "
                                                 "Default: %(default)s.")
    eps_clip: float = flag(0.2, "Lower ratio clip: ratio >= 1 - eps_clip. Default: %(default)s.")
    eps_clip_high: float | None = flag(None, "Upper ratio clip: ratio <= 1 + eps_clip_high (DAPO clip-higher). "
                                       "Default: None (= --eps-clip).")
    eps_clip_c: float | None = flag(None, "Dual-clip bound (> 1): for negative advantages the loss is capped at "
                                    "-A * eps_clip_c. Default: None (off).")
    cispo_eps_low: float | None = flag(None, "cispo: lower clip of the IS weight, weight >= 1 - cispo_eps_low (the "
                                       "upper one is --eps-clip-high). Default: None (no lower bound, as in "
                                       "MiniMax-M1).")
    value_clip: float = flag(0.2, "Critic update clip: |v - v_old| <= value_clip inside the value loss (ppo). "
                             "Default: %(default)s.")
    kl_coef: float = flag(0.0, "Per-token KL penalty subtracted from the reward (reinforce_plus_plus, ppo). "
                          "Default: %(default)s.")
    use_kl_loss: bool = flag(False, "Add kl_loss_coef * KL(policy || ref) to the loss. Default: off.")
    kl_loss_coef: float = flag(0.0, "Weight of the KL loss term. Default: %(default)s.")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = flag(
        "k1", "KL estimator (Schulman's k1/k2/k3; low_var_kl = k3 clamped to [-10, 10]). Default: %(default)s.")
    ref_update_interval: int | None = flag(None, "Refresh the KL reference from the actor after every this many "
                                           "rollouts (slime's). Default: None = the reference stays the --ref-load "
                                           "/ starting weights.")
    entropy_coef: float = flag(0.0, "Entropy bonus: entropy_coef * entropy is subtracted from the loss (the "
                               "schedule's start value). Default: %(default)s.")
    entropy_coef_schedule: Literal["constant", "linear", "cosine"] = flag(
        "constant", "How the entropy coefficient moves from --entropy-coef at rollout 0 to --entropy-coef-final at "
        "--entropy-coef-decay-rollouts. Default: %(default)s.")
    entropy_coef_final: float = flag(0.0, "The entropy coefficient at the end of a linear / cosine schedule. "
                                     "Default: %(default)s.")
    entropy_coef_decay_rollouts: int | None = flag(None, "Rollouts over which the schedule moves. Default: None "
                                                   "(--num-rollout).")
    entropy_top_fraction: float | None = flag(
        None, "Train only on this fraction of each micro-batch's trainable tokens, those of highest entropy (Wang "
        "et al. 2025's 0.2 forking tokens); the others leave the policy loss, the denominators stay the step's. "
        "Default: None (every token).")
    overlong_buffer_len: int | None = flag(
        None, "DAPO's soft overlong penalty: responses longer than --rollout-max-response-len minus this get a "
        "reward penalty growing linearly to --overlong-penalty-factor at the maximum. Default: None (off).")
    overlong_penalty_factor: float = flag(1.0, "The overlong penalty at the maximum response length. "
                                          "Default: %(default)s.")
    mask_truncated_samples: bool = flag(False, "DAPO's overlong filtering: samples truncated at the length limit "
                                        "are masked out of the loss (and of group baselines). Default: off.")
    use_critic: bool = derived(False)  # PPO trains a critic: set by validation from --advantage-estimator
    loss_agg_mode: str = flag(
        "token_mean", "How per-token losses become one number: mean over all trainable tokens (token_mean; dapo, "
        "TRL's name for it), per-sequence mean / sum then mean over sequences, seq_mean_token_sum_norm (Dr. GRPO: "
        "token sum / (sequences * --rollout-max-response-len)), or bnpo (TRL: token mean per micro-batch, "
        "averaged). Default: %(default)s.", choices=LOSS_AGG_MODES)

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

    use_tis: bool = flag(
        False, "Truncated importance sampling: weight the policy loss by w = exp(old_logp - rollout_logp) clamped "
        "to [--tis-clip-low, --tis-clip]. With PPO's clip this is AReaL's decoupled objective (the trainer's old "
        "log-probs are the proximal policy, the engine's the behaviour policy). Default: off.")
    tis_clip: float = flag(2.0, "Upper truncation of the TIS weight. Default: %(default)s.")
    tis_clip_low: float = flag(0.0, "Lower truncation of the TIS weight. Default: %(default)s.")
    tis_level: Literal["token", "sequence", "geometric"] = flag(
        "token", "TIS weight per token, per sequence (the product of its tokens' ratios) or per sequence as their "
        "geometric mean. Default: %(default)s.")
    custom_tis_function_path: str | None = flag(
        None, "Replace the built-in TIS (with --use-tis) by fn(args, *, pg_loss, train_log_probs, "
        "rollout_log_probs, loss_masks, total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics), "
        "slime's signature: pg_loss and each metric are per-token tensors over the micro-batch's concatenated "
        "responses, the log-probs and masks lists of one tensor per sample. Tokens whose returned mask is 0 leave "
        "the policy loss; the step's denominators stay those of the original masks. Default: none.")
    use_mis: bool = flag(
        False, "Masked importance sampling: weight the policy loss by w = exp(old_logp - rollout_logp) where w lies "
        "in [--mis-threshold-low, --mis-threshold-high] and mask the token (or sequence) out where it does not; at "
        "token level this is ICE-POP. Excludes --use-tis. Default: off.")
    mis_level: Literal["token", "sequence", "geometric"] = flag(
        "token", "MIS decision per token, per sequence on the product of its tokens' ratios (the sequence "
        "likelihood ratio), or per sequence on their geometric mean. Default: %(default)s.")
    mis_threshold_low: float = flag(0.5, "Smallest MIS weight kept. Default: %(default)s.")
    mis_threshold_high: float = flag(2.0, "Largest MIS weight kept. Default: %(default)s.")
    use_rollout_logprobs: bool = flag(
        False, "Bypass: the engine's log-probs are the old policy of the policy loss (PPO's ratio is pi / "
        "pi_engine), so the trainer skips its old-log-prob forward pass; no correction weight is applied. "
        "Samples without engine log-probs fall back to the trainer's. Default: off.")

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

    opd_teacher_checkpoint: str | None = flag(
        None, "HF checkpoint of a teacher with the student's architecture: the trainer scores the student's "
        "sampled tokens with it (swapping its weights in, as for the KL reference) and pulls the student toward it "
        "by the per-token reverse KL. Combines with any --advantage-estimator. Default: None (off).")
    opd_mode: Literal["reward", "loss"] = flag(
        "reward", "reward: add -opd_coef * (logp_student - logp_teacher) to each token's advantage; loss: add "
        "opd_coef * KL(student || teacher) (--opd-kl-type) to the loss. Default: %(default)s.")
    opd_coef: float = flag(1.0, "Weight of the distillation term. Default: %(default)s.")
    opd_kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = flag(
        "k3", "KL estimator of --opd-mode loss (k3: unbiased, low variance, non-negative). Default: %(default)s.")

    def check(self) -> None:
        if self.opd_teacher_checkpoint is not None and self.opd_coef <= 0:
            raise ValueError(f"--opd-coef must be > 0, got {self.opd_coef}; omit --opd-teacher-checkpoint "
                             "for no distillation")
