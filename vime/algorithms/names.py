"""The names the algorithm flags accept, apart from the torch code that implements them: parsing a run's flags
imports no torch (about 1 s of every driver's start). The registries in advantages.py and losses.py hold exactly
the built-in names listed here (tests/unit/test_algorithm_names.py)."""

ADVANTAGE_ESTIMATOR_NAMES = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
POLICY_LOSS_NAMES = ("ppo", "gspo", "cispo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
MIS_LEVELS = ("token", "sequence")
OPD_MODES = ("reward", "loss")  # on-policy distillation: the teacher's log-ratio as the reward, or as a loss term
