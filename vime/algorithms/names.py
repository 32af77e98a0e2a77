"""The names the algorithm flags accept, apart from the torch code that implements them: parsing a run's flags
imports no torch (about 1 s of every driver's start). The registries in advantages.py and losses.py hold exactly
the built-in names listed here and with the flags' sections (ADVANTAGE_ESTIMATOR_NAMES, POLICY_LOSS_NAMES,
LOSS_AGG_MODES in vime/config/algorithm.py; tests/unit/test_algorithm_names.py)."""

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
# sample metadata the rollout writes for --advantage-estimator remax: the reward of the group's greedy response
REMAX_GREEDY_REWARD_KEY = "remax_greedy_reward"
CORRECTION_LEVELS = ("token", "sequence", "geometric")  # rollout correction: one weight per token or per sequence
OPD_MODES = ("reward", "loss")  # on-policy distillation: the teacher's log-ratio as the reward, or as a loss term
