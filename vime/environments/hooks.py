"""The generate and reward functions of a run with `--environment` (set by `validate_environment_args` as
--custom-generate-function-path / --custom-rm-path): each sample goes to the environment it is tagged with, found
in the rollout context where the rollout manager put the run's environments."""

from __future__ import annotations

from typing import Any

from vime.data.sample import Sample
from vime.environments.mixture import sample_environment
from vime.rollout.context import rollout_context
from vime.rollout.vllm_rollout import generate as vime_generate

GENERATE_PATH = "vime.environments.hooks.generate"
REWARD_PATH = "vime.environments.hooks.reward"


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """The sample's environment's own generation (multi-turn kinds), else vime's single-turn generate."""
    env = sample_environment(rollout_context().environments, sample)
    if env.generate is None:
        return await vime_generate(args, sample, sampling_params)
    return await env.generate(args, sample, sampling_params)


async def reward(args, sample: Sample | list[Sample]) -> float | list[float]:
    """One sample's reward from its environment; with --group-rm (an environment whose rewards need the whole
    group) a group's rewards, all from the group's environment."""
    environments = rollout_context().environments
    if isinstance(sample, list):
        env = sample_environment(environments, sample[0])
        return list(await env.score_group(args, sample))
    return await sample_environment(environments, sample).score(args, sample)
