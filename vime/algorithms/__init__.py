"""RL math as pure functions on tensors: advantage estimators, losses, KL, TIS, and their flags.

The names below are imported from their modules on first use, so that the flags (`vime.algorithms.arguments`,
`vime.algorithms.names`) come without torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "advantages": ("ADVANTAGE_ESTIMATORS", "gae_advantages", "get_advantage_estimator", "grpo_advantages",
                   "gspo_advantages", "masked_mean_std", "register_advantage_estimator",
                   "reinforce_plus_plus_advantages", "reinforce_plus_plus_baseline_advantages", "remax_advantages",
                   "rloo_advantages", "whiten"),
    "arguments": ("add_algorithm_args", "validate_algorithm_args"),
    "losses": ("POLICY_LOSSES", "aggregate_loss", "compute_approx_kl", "compute_log_probs_from_logits",
               "entropy_from_logits", "get_policy_loss", "gspo_policy_loss",
               "ppo_policy_loss", "register_policy_loss", "sft_loss", "value_loss", "clip_cov_policy_loss",
               "kl_cov_policy_loss", "top_entropy_mask"),
    "rollout_correction": ("compute_tis_weights", "compute_mis_weights", "truncated_weights",
                           "correction_log_ratios"),
    "shaping": ("entropy_coef_at", "overlong_penalties", "mask_truncated"),
    "eval_metrics": ("pass_at_k", "eval_at_k_metrics"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
