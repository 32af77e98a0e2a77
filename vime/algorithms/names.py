"""The names the algorithm flags accept, apart from the torch code that implements them: parsing a run's flags
imports no torch (about 1 s of every driver's start). The registries in advantages.py and losses.py hold exactly
the built-in names listed here (tests/unit/test_algorithm_names.py)."""

ADVANTAGE_ESTIMATOR_NAMES = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
                             "rloo", "remax")
POLICY_LOSS_NAMES = ("ppo", "gspo", "cispo", "clip_cov", "kl_cov")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "bnpo", "dapo")
ENTROPY_COEF_SCHEDULES = ("constant", "linear", "cosine")
# sample metadata the rollout writes for --advantage-estimator remax: the reward of the group's greedy response
REMAX_GREEDY_REWARD_KEY = "remax_greedy_reward"
CORRECTION_LEVELS = ("token", "sequence", "geometric")  # rollout correction: one weight per token or per sequence
OPD_MODES = ("reward", "loss")  # on-policy distillation: the teacher's log-ratio as the reward, or as a loss term
