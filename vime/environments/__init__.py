"""Environments researchers already have, behind `--environment KIND:TARGET` (repeatable, a weighted mixture).

- `reasoning_gym:<dataset>[,<dataset>...]`: reasoning-gym's procedural tasks and exact scorers (`reasoning_gym_env`)
- `openenv:<module or URL>`: an OpenEnv environment stepped turn by turn (`openenv_env`)
- `verifiers:...` is refused with the reason (`base.NOT_YET`): verifiers 0.4 cannot be installed beside the test
  extra's openai-agents.

A judge served by the run (`--judge-checkpoint`, `judge`) gives reward functions a model to call.

Each library is an optional extra (`pip install -e .[envs]`), imported only when its kind is used. The rollout
manager loads the environments (`mixture.load_environments`), draws training groups from them by weight
(`mixture.EnvironmentMixSource`) and makes one eval set per environment; `hooks.generate` and `hooks.reward` are
the generate and reward functions such a run uses, dispatching on the environment each sample is tagged with
(`metadata["environment"]`). Who calls what: the rollout manager (loading, sources, closing), the default rollout
(the hooks), `vime.rollout.metrics` (per-environment and per-reward-function metrics from the samples).
"""
