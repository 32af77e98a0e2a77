"""Environments researchers already have, behind `--environment KIND:TARGET` (repeatable, a weighted mixture).

- `reasoning_gym:<dataset>[,<dataset>...]`: reasoning-gym's procedural tasks and exact scorers (`reasoning_gym_env`)
- `openenv:<module or URL>`: an OpenEnv environment stepped turn by turn (`openenv_env`)
- `verifiers:<taskset id or module>`: a verifiers 0.4 environment, run in verifiers' own venv by a bridge process
  (`verifiers_env`, `verifiers_process`, `verifiers_bridge`): verifiers requires openai<3, which vime's venv (the
  test extra's openai-agents) excludes

A judge served by the run (`--judge-checkpoint`, `judge`) gives reward functions a model to call.

reasoning-gym and OpenEnv are an optional extra (`pip install -e .[envs]`), imported only when their kind is used;
verifiers lives in `.venv-verifiers` (scripts/install.sh) and is never imported by vime. The rollout
manager loads the environments (`mixture.load_environments`), draws training groups from them by weight
(`mixture.EnvironmentMixSource`) and makes one eval set per environment; `hooks.generate` and `hooks.reward` are
the generate and reward functions such a run uses, dispatching on the environment each sample is tagged with
(`metadata["environment"]`). Who calls what: the rollout manager (loading, sources, closing), the default rollout
(the hooks), `vime.rollout.metrics` (per-environment and per-reward-function metrics from the samples).
"""
