"""RL math as pure functions on tensors: advantage estimators, losses, KL, TIS, and their flags."""

from vime.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
    gspo_advantages,
    register_advantage_estimator,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    whiten,
)
from vime.algorithms.arguments import add_algorithm_args, validate_algorithm_args
from vime.algorithms.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    compute_approx_kl,
    compute_log_probs_from_logits,
    compute_tis_weights,
    entropy_from_logits,
    get_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    register_policy_loss,
    sft_loss,
    value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "add_algorithm_args",
    "aggregate_loss",
    "compute_approx_kl",
    "compute_log_probs_from_logits",
    "compute_tis_weights",
    "entropy_from_logits",
    "gae_advantages",
    "get_advantage_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "gspo_advantages",
    "gspo_policy_loss",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "sft_loss",
    "validate_algorithm_args",
    "value_loss",
    "whiten",
]
