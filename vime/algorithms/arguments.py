"""Command-line flags for the RL algorithm (advantages, policy / value / KL / entropy losses, TIS, MIS)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from vime.algorithms.names import (ADVANTAGE_ESTIMATOR_NAMES, KL_TYPES, LOSS_AGG_MODES, MIS_LEVELS, OPD_MODES,
                                   POLICY_LOSS_NAMES)
from vime.utils.misc import with_values

logger = logging.getLogger(__name__)

LOSS_TYPES = ("policy_loss", "sft_loss", "value_loss")
# Estimators that put --kl-coef into the per-token reward; the others ignore it.
KL_REWARD_ESTIMATORS = ("reinforce_plus_plus", "ppo")
# Estimators that imply their own policy loss (the same name).
LOSS_SELECTING_ESTIMATORS = ("gspo", "cispo")


def add_algorithm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("algorithm")

    g.add_argument(
        "--advantage-estimator",
        choices=ADVANTAGE_ESTIMATOR_NAMES,
        default="grpo",
        help="How per-token advantages are computed from rewards; ppo trains a critic (GAE). Default: grpo.",
    )
    g.add_argument(
        "--custom-advantage-function-path",
        default=None,
        help="'pkg.module.function' replacing the estimator; called with the same keywords as the registered "
        "estimators (see vime/algorithms/advantages.py). Default: None.",
    )
    g.add_argument(
        "--disable-grpo-std-normalization",
        action="store_true",
        help="grpo/gspo/cispo: use r - mean(group) without dividing by the group std (Dr. GRPO). Default: off.",
    )
    g.add_argument(
        "--advantage-eps",
        type=float,
        default=1e-6,
        help="Added to the std in grpo normalisation and to the variance in whitening. Default: 1e-6.",
    )
    g.add_argument(
        "--gamma",
        type=float,
        default=1.0,
        help="Discount per trainable token (reinforce_plus_plus, ppo). Default: 1.0.",
    )
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda (ppo). Default: 1.0.")
    g.add_argument(
        "--normalize-advantages",
        action="store_true",
        help="ppo: whiten GAE advantages over the batch's trainable tokens (reinforce_plus_plus* always "
        "whiten). Default: off.",
    )

    g.add_argument(
        "--loss-type",
        choices=LOSS_TYPES,
        default="policy_loss",
        help="What the training step minimises; sft_loss is supervised fine-tuning on the loss-masked tokens. "
        "Default: policy_loss.",
    )
    g.add_argument(
        "--policy-loss",
        choices=POLICY_LOSS_NAMES,
        default="ppo",
        help="Token-level (ppo) or sequence-level (gspo) ratio in the clipped surrogate, or cispo's clipped, "
        "detached IS weight on -A * log-prob; forced to gspo / cispo by --advantage-estimator gspo / cispo. "
        "Default: ppo.",
    )
    g.add_argument(
        "--custom-loss-function-path",
        default=None,
        help="'pkg.module.function' replacing the whole training loss. Default: None.",
    )
    g.add_argument(
        "--eps-clip", type=float, default=0.2, help="Lower ratio clip: ratio >= 1 - eps_clip. Default: 0.2."
    )
    g.add_argument(
        "--eps-clip-high",
        type=float,
        default=None,
        help="Upper ratio clip: ratio <= 1 + eps_clip_high (DAPO clip-higher). Default: None (= --eps-clip).",
    )
    g.add_argument(
        "--eps-clip-c",
        type=float,
        default=None,
        help="Dual-clip bound (> 1): for negative advantages the loss is capped at -A * eps_clip_c. "
        "Default: None (off).",
    )
    g.add_argument(
        "--cispo-eps-low",
        type=float,
        default=None,
        help="cispo: lower clip of the IS weight, weight >= 1 - cispo_eps_low (the upper one is "
        "--eps-clip-high). Default: None (no lower bound, as in MiniMax-M1).",
    )
    g.add_argument(
        "--value-clip",
        type=float,
        default=0.2,
        help="Critic update clip: |v - v_old| <= value_clip inside the value loss (ppo). Default: 0.2.",
    )

    g.add_argument(
        "--kl-coef",
        type=float,
        default=0.0,
        help="Per-token KL penalty subtracted from the reward (reinforce_plus_plus, ppo). Default: 0.0.",
    )
    g.add_argument(
        "--use-kl-loss", action="store_true", help="Add kl_loss_coef * KL(policy || ref) to the loss. Default: off."
    )
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="Weight of the KL loss term. Default: 0.0.")
    g.add_argument(
        "--kl-loss-type",
        choices=KL_TYPES,
        default="k1",
        help="KL estimator (Schulman's k1/k2/k3; low_var_kl = k3 clamped to [-10, 10]). Default: k1.",
    )
    g.add_argument(
        "--entropy-coef",
        type=float,
        default=0.0,
        help="Entropy bonus: entropy_coef * entropy is subtracted from the loss. Default: 0.0.",
    )
    g.add_argument(
        "--loss-agg-mode",
        choices=LOSS_AGG_MODES,
        default="token_mean",
        help="How per-token losses become one number: mean over all trainable tokens, or per-sequence "
        "mean / sum then mean over sequences. Default: token_mean.",
    )

    g.add_argument(
        "--use-tis",
        action="store_true",
        help="Truncated importance sampling: weight the policy loss by exp(old_logp - rollout_logp) to correct "
        "the train/inference mismatch. Default: off.",
    )
    g.add_argument("--tis-clip", type=float, default=2.0, help="Upper truncation of the TIS weight. Default: 2.0.")
    g.add_argument(
        "--tis-clip-low", type=float, default=0.0, help="Lower truncation of the TIS weight. Default: 0.0."
    )
    g.add_argument(
        "--use-mis",
        action="store_true",
        help="Masked importance sampling: weight the policy loss by w = exp(old_logp - rollout_logp) where w lies "
        "in [--mis-threshold-low, --mis-threshold-high] and mask the token (or sequence) out where it does not. "
        "Excludes --use-tis. Default: off.",
    )
    g.add_argument(
        "--mis-level",
        choices=MIS_LEVELS,
        default="token",
        help="MIS decision per token, or per sequence on the product of its tokens' ratios (the sequence "
        "likelihood ratio). Default: token.",
    )
    g.add_argument(
        "--mis-threshold-low", type=float, default=0.5, help="Smallest MIS weight kept. Default: 0.5."
    )
    g.add_argument(
        "--mis-threshold-high", type=float, default=2.0, help="Largest MIS weight kept. Default: 2.0."
    )

    g = parser.add_argument_group("on-policy distillation")
    g.add_argument(
        "--opd-teacher-checkpoint",
        default=None,
        help="HF checkpoint of a teacher with the student's architecture: the trainer scores the student's sampled "
        "tokens with it (swapping its weights in, as for the KL reference) and pulls the student toward it by the "
        "per-token reverse KL. Combines with any --advantage-estimator. Default: None (off).",
    )
    g.add_argument(
        "--opd-mode",
        choices=OPD_MODES,
        default="reward",
        help="reward: add -opd_coef * (logp_student - logp_teacher) to each token's advantage; loss: add "
        "opd_coef * KL(student || teacher) (--opd-kl-type) to the loss. Default: reward.",
    )
    g.add_argument("--opd-coef", type=float, default=1.0, help="Weight of the distillation term. Default: 1.0.")
    g.add_argument(
        "--opd-kl-type", choices=KL_TYPES, default="k3",
        help="KL estimator of --opd-mode loss (k3: unbiased, low variance, non-negative). Default: k3.",
    )
    return parser


def validate_algorithm_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check flag combinations; returns a copy of `args` with the derived values: eps_clip_high, policy_loss
    (gspo / cispo when the estimator of that name is chosen), use_critic."""
    derived = {}
    if args.eps_clip <= 0:
        raise ValueError(f"--eps-clip must be > 0, got {args.eps_clip}")
    if args.eps_clip_high is None:
        derived["eps_clip_high"] = args.eps_clip
    elif args.eps_clip_high <= 0:
        raise ValueError(f"--eps-clip-high must be > 0, got {args.eps_clip_high}; omit it to use --eps-clip")
    if args.eps_clip_c is not None and args.eps_clip_c <= 1.0:
        raise ValueError(
            f"--eps-clip-c must be > 1.0 (it caps the loss of negative advantages at -A * eps_clip_c), "
            f"got {args.eps_clip_c}; pass a value such as 3.0 or omit the flag to disable dual clip"
        )
    if args.tis_clip_low > args.tis_clip:
        raise ValueError(
            f"--tis-clip-low ({args.tis_clip_low}) must be <= --tis-clip ({args.tis_clip}); "
            f"lower --tis-clip-low or raise --tis-clip"
        )
    if args.cispo_eps_low is not None and args.cispo_eps_low <= 0:
        raise ValueError(f"--cispo-eps-low must be > 0, got {args.cispo_eps_low}; omit it for no lower bound")
    if args.use_mis and args.use_tis:
        raise ValueError("--use-mis and --use-tis are mutually exclusive (both reweight the policy loss by "
                         "exp(old_logp - rollout_logp)); pass one of them")
    if not 0 <= args.mis_threshold_low < args.mis_threshold_high:
        raise ValueError(
            f"MIS thresholds must satisfy 0 <= --mis-threshold-low ({args.mis_threshold_low}) < "
            f"--mis-threshold-high ({args.mis_threshold_high})"
        )
    if args.use_kl_loss and args.kl_loss_coef == 0.0:
        logger.warning("--use-kl-loss is set but --kl-loss-coef is 0.0: the KL loss is logged but has no effect")
    if args.kl_coef != 0.0 and args.advantage_estimator not in KL_REWARD_ESTIMATORS:
        logger.warning(
            "--kl-coef %s is ignored by --advantage-estimator %s (only %s put KL into the reward); "
            "use --use-kl-loss --kl-loss-coef instead",
            args.kl_coef,
            args.advantage_estimator,
            ", ".join(KL_REWARD_ESTIMATORS),
        )
    if args.normalize_advantages and args.advantage_estimator != "ppo":
        logger.warning("--normalize-advantages only affects --advantage-estimator ppo; it is ignored here")
    if args.advantage_estimator in LOSS_SELECTING_ESTIMATORS and args.policy_loss != args.advantage_estimator:
        logger.info("--advantage-estimator %s: using --policy-loss %s", args.advantage_estimator,
                    args.advantage_estimator)
        derived["policy_loss"] = args.advantage_estimator
    if args.cispo_eps_low is not None and derived.get("policy_loss", args.policy_loss) != "cispo":
        logger.warning("--cispo-eps-low is ignored: the policy loss is not cispo")
    if args.opd_teacher_checkpoint is not None:
        if not (Path(args.opd_teacher_checkpoint) / "config.json").is_file():
            raise ValueError(f"--opd-teacher-checkpoint {args.opd_teacher_checkpoint}: no HF checkpoint there "
                             "(config.json missing)")
        if args.opd_coef <= 0:
            raise ValueError(f"--opd-coef must be > 0, got {args.opd_coef}; omit --opd-teacher-checkpoint for no "
                             "distillation")
    derived["use_critic"] = args.advantage_estimator == "ppo" or getattr(args, "use_critic", False)
    return with_values(args, **derived)
