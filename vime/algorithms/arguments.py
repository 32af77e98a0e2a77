"""Command-line flags for the RL algorithm (advantages, policy / value / KL / entropy losses, TIS, MIS)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from vime.algorithms.names import (ADVANTAGE_ESTIMATOR_NAMES, ENTROPY_COEF_SCHEDULES, KL_TYPES, LOSS_AGG_MODES,
                                   CORRECTION_LEVELS, OPD_MODES, POLICY_LOSS_NAMES)
from vime.config.algorithm import AlgorithmConfig, DistillationConfig, RolloutCorrectionConfig
from vime.config.rollout import RolloutConfig
from vime.config.run import JobConfig
from vime.config.section import apply_defaults
from vime.utils.misc import with_values

logger = logging.getLogger(__name__)

LOSS_TYPES = ("policy_loss", "sft_loss", "value_loss")
# Estimators that put --kl-coef into the per-token reward; the others ignore it.
KL_REWARD_ESTIMATORS = ("reinforce_plus_plus", "ppo")
# Estimators that imply their own policy loss (the same name).
LOSS_SELECTING_ESTIMATORS = ("gspo", "cispo")
# Estimators that read --disable-grpo-std-normalization
STD_NORMALISING_ESTIMATORS = ("grpo", "gspo", "cispo")


def add_algorithm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("algorithm")

    g.add_argument(
        "--advantage-estimator",
        choices=ADVANTAGE_ESTIMATOR_NAMES,
        help="How per-token advantages are computed from rewards; ppo trains a critic (GAE); rloo: leave-one-out "
        "group baseline; remax: a greedy response per prompt as the baseline (the rollout adds one temperature-0 "
        "request per group). Default: %(default)s.",
    )
    g.add_argument(
        "--custom-advantage-function-path",
        help="'pkg.module.function' replacing the estimator; called with the same keywords as the registered "
        "estimators (see vime/algorithms/advantages.py). Default: %(default)s.",
    )
    g.add_argument(
        "--disable-grpo-std-normalization",
        action="store_true",
        help="grpo/gspo/cispo: use r - mean(group) without dividing by the group std (Dr. GRPO). Default: off.",
    )
    g.add_argument(
        "--advantage-eps",
        type=float,
        help="Added to the std in grpo normalisation and to the variance in whitening. Default: 1e-6.",
    )
    g.add_argument(
        "--gamma",
        type=float,
        help="Discount per trainable token (reinforce_plus_plus, ppo). Default: %(default)s.",
    )
    g.add_argument("--lambd", type=float, help="GAE lambda (ppo). Default: %(default)s.")
    g.add_argument(
        "--normalize-advantages",
        action="store_true",
        help="ppo: whiten GAE advantages over the batch's trainable tokens (reinforce_plus_plus* always "
        "whiten). Default: off.",
    )

    g.add_argument(
        "--loss-type",
        choices=LOSS_TYPES,
        help="What the training step minimises; sft_loss is supervised fine-tuning on the loss-masked tokens. "
        "Default: %(default)s.",
    )
    g.add_argument(
        "--policy-loss",
        choices=POLICY_LOSS_NAMES,
        help="Token-level (ppo) or sequence-level (gspo) ratio in the clipped surrogate, or cispo's clipped, "
        "detached IS weight on -A * log-prob; forced to gspo / cispo by --advantage-estimator gspo / cispo. "
        "clip_cov / kl_cov: PPO against entropy collapse (Cui et al. 2025, verl), cutting the gradient of / "
        "adding a KL penalty to the tokens of highest advantage-log-prob covariance. Default: %(default)s.",
    )
    g.add_argument("--clip-cov-ratio", type=float,
                   help="clip_cov: fraction of the trainable tokens whose gradient is cut. Default: %(default)s.")
    g.add_argument("--clip-cov-lb", type=float,
                   help="clip_cov: only tokens of covariance above this are cut. Default: %(default)s.")
    g.add_argument("--clip-cov-ub", type=float,
                   help="clip_cov: only tokens of covariance below this are cut. Default: %(default)s.")
    g.add_argument("--kl-cov-ratio", type=float,
                   help="kl_cov: fraction of the trainable tokens (largest covariance) given the KL penalty. "
                   "Default: %(default)s.")
    g.add_argument("--ppo-kl-coef", type=float,
                   help="kl_cov: weight of |logp - old_logp| on the penalised tokens. Default: %(default)s.")
    g.add_argument(
        "--custom-loss-function-path",
        help="'pkg.module.function' replacing the whole training loss. Default: %(default)s.",
    )
    g.add_argument(
        "--eps-clip", type=float, help="Lower ratio clip: ratio >= 1 - eps_clip. Default: %(default)s."
    )
    g.add_argument(
        "--eps-clip-high",
        type=float,
        help="Upper ratio clip: ratio <= 1 + eps_clip_high (DAPO clip-higher). Default: None (= --eps-clip).",
    )
    g.add_argument(
        "--eps-clip-c",
        type=float,
        help="Dual-clip bound (> 1): for negative advantages the loss is capped at -A * eps_clip_c. "
        "Default: None (off).",
    )
    g.add_argument(
        "--cispo-eps-low",
        type=float,
        help="cispo: lower clip of the IS weight, weight >= 1 - cispo_eps_low (the upper one is "
        "--eps-clip-high). Default: None (no lower bound, as in MiniMax-M1).",
    )
    g.add_argument(
        "--value-clip",
        type=float,
        help="Critic update clip: |v - v_old| <= value_clip inside the value loss (ppo). Default: %(default)s.",
    )

    g.add_argument(
        "--kl-coef",
        type=float,
        help="Per-token KL penalty subtracted from the reward (reinforce_plus_plus, ppo). Default: %(default)s.",
    )
    g.add_argument(
        "--use-kl-loss", action="store_true", help="Add kl_loss_coef * KL(policy || ref) to the loss. Default: off."
    )
    g.add_argument("--kl-loss-coef", type=float, help="Weight of the KL loss term. Default: %(default)s.")
    g.add_argument(
        "--kl-loss-type",
        choices=KL_TYPES,
        help="KL estimator (Schulman's k1/k2/k3; low_var_kl = k3 clamped to [-10, 10]). Default: %(default)s.",
    )
    g.add_argument("--ref-update-interval", type=int,
                   help="Refresh the KL reference from the actor after every this many rollouts (slime's). "
                        "Default: None = the reference stays the --ref-load / starting weights.")
    g.add_argument(
        "--entropy-coef",
        type=float,
        help="Entropy bonus: entropy_coef * entropy is subtracted from the loss (the schedule's start value). "
        "Default: %(default)s.",
    )
    g.add_argument("--entropy-coef-schedule", choices=ENTROPY_COEF_SCHEDULES,
                   help="How the entropy coefficient moves from --entropy-coef at rollout 0 to --entropy-coef-final "
                   "at --entropy-coef-decay-rollouts. Default: %(default)s.")
    g.add_argument("--entropy-coef-final", type=float,
                   help="The entropy coefficient at the end of a linear / cosine schedule. Default: %(default)s.")
    g.add_argument("--entropy-coef-decay-rollouts", type=int,
                   help="Rollouts over which the schedule moves. Default: None (--num-rollout).")
    g.add_argument("--entropy-top-fraction", type=float,
                   help="Train only on this fraction of each micro-batch's trainable tokens, those of highest "
                   "entropy (Wang et al. 2025's 0.2 forking tokens); the others leave the policy loss, the "
                   "denominators stay the step's. Default: None (every token).")
    g.add_argument("--overlong-buffer-len", type=int,
                   help="DAPO's soft overlong penalty: responses longer than --rollout-max-response-len minus this "
                   "get a reward penalty growing linearly to --overlong-penalty-factor at the maximum. "
                   "Default: None (off).")
    g.add_argument("--overlong-penalty-factor", type=float,
                   help="The overlong penalty at the maximum response length. Default: %(default)s.")
    g.add_argument("--mask-truncated-samples", action="store_true",
                   help="DAPO's overlong filtering: samples truncated at the length limit are masked out of the loss "
                   "(and of group baselines). Default: off.")
    g.add_argument(
        "--loss-agg-mode",
        choices=LOSS_AGG_MODES,
        help="How per-token losses become one number: mean over all trainable tokens (token_mean; dapo, TRL's "
        "name for it), per-sequence mean / sum then mean over sequences, seq_mean_token_sum_norm (Dr. GRPO: token "
        "sum / (sequences * --rollout-max-response-len)), or bnpo (TRL: token mean per micro-batch, averaged). "
        "Default: %(default)s.",
    )

    g = parser.add_argument_group(
        "rollout correction", "importance weights pi_old / pi_engine for tokens the engine sampled under another "
        "policy (vime/algorithms/rollout_correction.py)")
    g.add_argument(
        "--use-tis",
        action="store_true",
        help="Truncated importance sampling: weight the policy loss by w = exp(old_logp - rollout_logp) clamped to "
        "[--tis-clip-low, --tis-clip]. With PPO's clip this is AReaL's decoupled objective (the trainer's old "
        "log-probs are the proximal policy, the engine's the behaviour policy). Default: off.",
    )
    g.add_argument("--tis-clip", type=float, help="Upper truncation of the TIS weight. Default: %(default)s.")
    g.add_argument(
        "--tis-clip-low", type=float, help="Lower truncation of the TIS weight. Default: %(default)s."
    )
    g.add_argument(
        "--tis-level",
        choices=CORRECTION_LEVELS,
        help="TIS weight per token, per sequence (the product of its tokens' ratios) or per sequence as their "
        "geometric mean. Default: %(default)s.",
    )
    g.add_argument(
        "--custom-tis-function-path",
        help="Replace the built-in TIS (with --use-tis) by fn(args, *, pg_loss, train_log_probs, rollout_log_probs, "
        "loss_masks, total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics), slime's signature: "
        "pg_loss and each metric are per-token tensors over the micro-batch's concatenated responses, the log-probs "
        "and masks lists of one tensor per sample. Tokens whose returned mask is 0 leave the policy loss; the "
        "step's denominators stay those of the original masks. Default: none.",
    )
    g.add_argument(
        "--use-mis",
        action="store_true",
        help="Masked importance sampling: weight the policy loss by w = exp(old_logp - rollout_logp) where w lies "
        "in [--mis-threshold-low, --mis-threshold-high] and mask the token (or sequence) out where it does not; at "
        "token level this is ICE-POP. Excludes --use-tis. Default: off.",
    )
    g.add_argument(
        "--mis-level",
        choices=CORRECTION_LEVELS,
        help="MIS decision per token, per sequence on the product of its tokens' ratios (the sequence likelihood "
        "ratio), or per sequence on their geometric mean. Default: %(default)s.",
    )
    g.add_argument(
        "--mis-threshold-low", type=float, help="Smallest MIS weight kept. Default: %(default)s."
    )
    g.add_argument(
        "--mis-threshold-high", type=float, help="Largest MIS weight kept. Default: %(default)s."
    )
    g.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="Bypass: the engine's log-probs are the old policy of the policy loss (PPO's ratio is pi / "
        "pi_engine), so the trainer skips its old-log-prob forward pass; no correction weight is applied. "
        "Samples without engine log-probs fall back to the trainer's. Default: off.",
    )

    g = parser.add_argument_group("on-policy distillation")
    g.add_argument(
        "--opd-teacher-checkpoint",
        help="HF checkpoint of a teacher with the student's architecture: the trainer scores the student's sampled "
        "tokens with it (swapping its weights in, as for the KL reference) and pulls the student toward it by the "
        "per-token reverse KL. Combines with any --advantage-estimator. Default: None (off).",
    )
    g.add_argument(
        "--opd-mode",
        choices=OPD_MODES,
        help="reward: add -opd_coef * (logp_student - logp_teacher) to each token's advantage; loss: add "
        "opd_coef * KL(student || teacher) (--opd-kl-type) to the loss. Default: %(default)s.",
    )
    g.add_argument("--opd-coef", type=float, help="Weight of the distillation term. Default: %(default)s.")
    g.add_argument(
        "--opd-kl-type", choices=KL_TYPES,
        help="KL estimator of --opd-mode loss (k3: unbiased, low variance, non-negative). Default: %(default)s.",
    )
    apply_defaults(parser, AlgorithmConfig, RolloutCorrectionConfig, DistillationConfig)  # defaults: vime/config
    return parser


def validate_algorithm_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check flag combinations; returns a copy of `args` with the derived values: eps_clip_high, policy_loss
    (gspo / cispo when the estimator of that name is chosen), use_critic."""
    algorithm = AlgorithmConfig.of(args)
    correction = RolloutCorrectionConfig.of(args)
    distillation = DistillationConfig.of(args)
    for section in (algorithm, correction, distillation):
        section.check()
    derived = {}
    if algorithm.eps_clip_high is None:
        derived["eps_clip_high"] = algorithm.eps_clip
    if algorithm.use_kl_loss and algorithm.kl_loss_coef == 0.0:
        logger.warning("--use-kl-loss is set but --kl-loss-coef is 0.0: the KL loss is logged but has no effect")
    if algorithm.kl_coef != 0.0 and algorithm.advantage_estimator not in KL_REWARD_ESTIMATORS:
        logger.warning(
            "--kl-coef %s is ignored by --advantage-estimator %s (only %s put KL into the reward); "
            "use --use-kl-loss --kl-loss-coef instead",
            algorithm.kl_coef,
            algorithm.advantage_estimator,
            ", ".join(KL_REWARD_ESTIMATORS),
        )
    if algorithm.ref_update_interval is not None and not (algorithm.use_kl_loss or algorithm.kl_coef):
        logger.warning("--ref-update-interval %s has no effect: no KL reference without --use-kl-loss or --kl-coef",
                       algorithm.ref_update_interval)
    if algorithm.normalize_advantages and algorithm.advantage_estimator != "ppo":
        logger.warning("--normalize-advantages only affects --advantage-estimator ppo; it is ignored here")
    estimator = algorithm.advantage_estimator
    if estimator in LOSS_SELECTING_ESTIMATORS and algorithm.policy_loss != estimator:
        logger.info("--advantage-estimator %s: using --policy-loss %s", algorithm.advantage_estimator,
                    algorithm.advantage_estimator)
        derived["policy_loss"] = algorithm.advantage_estimator
    if algorithm.cispo_eps_low is not None and derived.get("policy_loss", algorithm.policy_loss) != "cispo":
        logger.warning("--cispo-eps-low is ignored: the policy loss is not cispo")
    if distillation.opd_teacher_checkpoint is not None:
        if not (Path(distillation.opd_teacher_checkpoint) / "config.json").is_file():
            raise ValueError(f"--opd-teacher-checkpoint {distillation.opd_teacher_checkpoint}: no HF checkpoint there "
                             "(config.json missing)")
    derived.update(_validate_estimator_shaping_entropy_flags(args, derived.get("policy_loss", algorithm.policy_loss)))
    derived["use_critic"] = algorithm.advantage_estimator == "ppo" or algorithm.use_critic
    return with_values(args, **derived)


def _validate_estimator_shaping_entropy_flags(args: argparse.Namespace, policy_loss: str) -> dict:
    """RLOO / ReMax, Dr. GRPO and the TRL normalisations, DAPO's overlong shaping and filtering, entropy-aware
    updates (top fraction, Clip-Cov / KL-Cov, the coefficient's schedule); returns the derived values."""
    rollout = RolloutConfig.of(args)
    algorithm = AlgorithmConfig.of(args)
    job = JobConfig.of(args)
    derived = {}
    max_len = rollout.rollout_max_response_len
    if algorithm.advantage_estimator == "rloo" and rollout.n_samples_per_prompt < 2:
        raise ValueError("--advantage-estimator rloo takes each sample's baseline from the other samples of its "
                         f"group; --n-samples-per-prompt {rollout.n_samples_per_prompt} must be >= 2")
    if algorithm.advantage_estimator == "remax" and rollout.rollout_function_path != \
            "vime.rollout.vllm_rollout.generate_rollout":
        logger.warning("--advantage-estimator remax: --rollout-function-path %s must write each sample's greedy "
                       "baseline reward into metadata['remax_greedy_reward'] (the default rollout does)",
                       rollout.rollout_function_path)
    if algorithm.disable_grpo_std_normalization and algorithm.advantage_estimator not in STD_NORMALISING_ESTIMATORS:
        logger.warning("--disable-grpo-std-normalization only affects --advantage-estimator %s; ignored by %s",
                       " / ".join(STD_NORMALISING_ESTIMATORS), algorithm.advantage_estimator)
    if algorithm.loss_agg_mode == "seq_mean_token_sum_norm" \
            and algorithm.advantage_estimator in STD_NORMALISING_ESTIMATORS \
            and not algorithm.disable_grpo_std_normalization:
        logger.warning("--loss-agg-mode seq_mean_token_sum_norm without --disable-grpo-std-normalization is not "
                       "Dr. GRPO: its advantages are still divided by the group std")
    buffer_len = algorithm.overlong_buffer_len
    if buffer_len is not None and (buffer_len < 1 or (max_len is not None and buffer_len > max_len)):
        raise ValueError(f"--overlong-buffer-len {buffer_len} must lie in [1, --rollout-max-response-len {max_len}]")
    if policy_loss in ("clip_cov", "kl_cov"):
        ratio_flag = "--clip-cov-ratio" if policy_loss == "clip_cov" else "--kl-cov-ratio"
        ratio = algorithm.clip_cov_ratio if policy_loss == "clip_cov" else algorithm.kl_cov_ratio
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"{ratio_flag} must lie in (0, 1], got {ratio}")
        if algorithm.eps_clip_c is not None:
            raise ValueError(f"--policy-loss {policy_loss} has no dual clip; drop --eps-clip-c")
    if policy_loss == "clip_cov" and not algorithm.clip_cov_lb < algorithm.clip_cov_ub:
        raise ValueError(f"--clip-cov-lb ({algorithm.clip_cov_lb}) must be < --clip-cov-ub ({algorithm.clip_cov_ub})")
    if policy_loss == "kl_cov" and algorithm.ppo_kl_coef < 0:
        raise ValueError(f"--ppo-kl-coef must be >= 0, got {algorithm.ppo_kl_coef}")
    if algorithm.policy_loss in ("clip_cov", "kl_cov") and algorithm.advantage_estimator in LOSS_SELECTING_ESTIMATORS:
        raise ValueError(f"--policy-loss {algorithm.policy_loss} and --advantage-estimator "
                         f"{algorithm.advantage_estimator} "
                         f"(which brings its own {algorithm.advantage_estimator} loss) exclude each other; use "
                         "--advantage-estimator grpo with it")
    if algorithm.entropy_coef_schedule != "constant":
        decay = algorithm.entropy_coef_decay_rollouts or job.num_rollout
        if not decay or decay < 1:
            raise ValueError(f"--entropy-coef-schedule {algorithm.entropy_coef_schedule} needs "
                             "--entropy-coef-decay-rollouts N (or --num-rollout) >= 1")
        derived["entropy_coef_decay_rollouts"] = decay
        if algorithm.entropy_coef == algorithm.entropy_coef_final:
            logger.warning("--entropy-coef-schedule %s from --entropy-coef %s to --entropy-coef-final %s: "
                           "the coefficient never moves", algorithm.entropy_coef_schedule, algorithm.entropy_coef,
                           algorithm.entropy_coef_final)
    elif algorithm.entropy_coef_decay_rollouts is not None:
        logger.warning("--entropy-coef-decay-rollouts is ignored with --entropy-coef-schedule constant")
    return derived
