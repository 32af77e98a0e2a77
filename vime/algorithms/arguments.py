"""Command-line flags for the RL algorithm (advantages, policy / value / KL / entropy losses, TIS, MIS)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from vime.config.algorithm import AlgorithmConfig, DistillationConfig, RolloutCorrectionConfig
from vime.config.rollout import RolloutConfig
from vime.config.run import JobConfig
from vime.config.section import add_flags
from vime.utils.misc import with_values

logger = logging.getLogger(__name__)

# Estimators that put --kl-coef into the per-token reward; the others ignore it.
KL_REWARD_ESTIMATORS = ("reinforce_plus_plus", "ppo")
# Estimators that imply their own policy loss (the same name).
LOSS_SELECTING_ESTIMATORS = ("gspo", "cispo")
# Estimators that read --disable-grpo-std-normalization
STD_NORMALISING_ESTIMATORS = ("grpo", "gspo", "cispo")


def add_algorithm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_flags(parser.add_argument_group("algorithm"), AlgorithmConfig)
    add_flags(parser.add_argument_group(
        "rollout correction", "importance weights pi_old / pi_engine for tokens the engine sampled under another "
        "policy (vime/algorithms/rollout_correction.py)"), RolloutCorrectionConfig)
    add_flags(parser.add_argument_group("on-policy distillation"), DistillationConfig)
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
