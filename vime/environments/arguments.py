"""Flags of `--environment` runs (`vime.environments`) and their validation.

`validate_environment_args` runs before the rollout side's validation: a run with environments takes its prompts,
rewards and (for multi-turn kinds) generation from them, so it sets --custom-rm-path (and
--custom-generate-function-path for multi-turn kinds) to the environment hooks and refuses flags that would
compete with them.
"""

from __future__ import annotations

import argparse
import importlib.util

from vime.config.agents import EnvironmentConfig, JudgeConfig
from vime.config.rollout import EnginesConfig, PromptDataConfig, RewardConfig, RolloutConfig
from vime.config.section import add_flags
from vime.config.train import LoraConfig
from vime.environments.base import EnvironmentSpec
from vime.environments.hooks import GENERATE_PATH, REWARD_PATH
from vime.environments.mixture import environment_specs
from vime.utils.misc import with_values

# kind -> (module whose presence says the library is installed, PyPI name); verifiers lives in a venv of its own
LIBRARIES = {"reasoning_gym": ("reasoning_gym", "reasoning-gym"), "openenv": ("openenv", "openenv-core")}
MULTI_TURN_KINDS = ("openenv", "verifiers")  # kinds that generate through their own loop


def add_environment_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("environments (reasoning-gym, OpenEnv: pip install -e '.[envs]'; verifiers: its own "
                                  "venv, scripts/install.sh)")
    add_flags(g, EnvironmentConfig)


def add_judge_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("judge (a judge or reward model served by the run; vime.environments.judge)")
    add_flags(g, JudgeConfig)


def validate_judge_args(args: argparse.Namespace) -> None:
    judge = JudgeConfig.of(args)
    engines = EnginesConfig.of(args)
    if judge.judge_checkpoint is None:
        return
    import os

    if not os.path.isfile(os.path.join(judge.judge_checkpoint, "config.json")):
        raise ValueError(f"--judge-checkpoint {judge.judge_checkpoint}: no config.json there; is it an HF checkpoint?")
    judge.check()
    if engines.rollout_external_engine_addrs:
        raise ValueError("--judge-checkpoint starts the judge's engines on this node; it is not yet supported with "
                         "--rollout-external-engine-addrs")


def check_installed(specs: list[EnvironmentSpec]) -> None:
    """Each kind's library is installed, or a one-line error naming the extra (before anything starts)."""
    for kind in dict.fromkeys(s.kind for s in specs):
        if kind == "verifiers":
            continue  # in its own venv: `verifiers_process.verifiers_python` checks it (validate_environment_args)
        module, package = LIBRARIES[kind]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"--environment {kind}:... needs the {package} package, which is not installed: "
                             "pip install -e '.[envs]'")


def validate_environment_args(args: argparse.Namespace) -> argparse.Namespace:
    """Refuse flags that compete with --environment; set the environment hooks as the run's reward (and generate)
    functions. Returns `args` unchanged without --environment."""
    environments = EnvironmentConfig.of(args)
    validate_judge_args(args)
    specs = environment_specs(args)  # bad kinds, weights, JSON: refused here
    if not specs:
        for flag, given in (("--environment-weights", environments.environment_weights),
                            ("--environment-args", environments.environment_args)):
            if given:
                raise ValueError(f"{flag} needs --environment")
        return args
    rewards = RewardConfig.of(args)
    competing = [flag for flag, given in (("--prompt-data", PromptDataConfig.of(args).prompt_data),
                                          ("--custom-rm-path", rewards.custom_rm_path), ("--rm-type", rewards.rm_type),
                                          ("--lora-adapters", LoraConfig.of(args).lora_adapters),
                                          ("--custom-generate-function-path",
                                           RolloutConfig.of(args).custom_generate_function_path)) if given]
    if competing:
        raise ValueError("--environment gives the run its prompts, rewards and generation: drop "
                         + ", ".join(competing))
    if environments.environment_eval_size < 0:
        raise ValueError(f"--environment-eval-size must be >= 0, got {environments.environment_eval_size}")
    if environments.reasoning_gym_size < 1:
        raise ValueError(f"--reasoning-gym-size must be >= 1, got {environments.reasoning_gym_size}")
    if environments.reasoning_gym_weights and sum(s.kind == "reasoning_gym" for s in specs) != 1:
        raise ValueError("--reasoning-gym-weights weighs the datasets of one reasoning_gym spec; with several, "
                         "weigh the specs with --environment-weights")
    check_installed(specs)
    kinds = {s.kind for s in specs}
    if "verifiers" in kinds:
        from vime.environments.verifiers_process import verifiers_python

        verifiers_python(environments.verifiers_python)
    derived = {"custom_rm_path": REWARD_PATH}
    if kinds & set(MULTI_TURN_KINDS):
        derived["custom_generate_function_path"] = GENERATE_PATH
    return with_values(args, **derived)
