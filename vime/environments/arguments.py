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
from vime.config.section import apply_defaults
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
    g.add_argument("--environment", action="append", metavar="KIND:TARGET",
                   help="An environment to train on, repeatable (a mixture): reasoning_gym:<dataset>[,<dataset>...], "
                        "openenv:<app module or http://host:port>, verifiers:<taskset id or module>. Its prompts, "
                        "rewards (each reward function reported as its own metric) and, for multi-turn kinds, its "
                        "turns replace --prompt-data and --rm-type (default: %(default)s).")
    g.add_argument("--environment-weights", type=float, nargs="+",
                   help="Mixture weight of each --environment, in order: the share of training groups drawn from it "
                        "(default: 1 each).")
    g.add_argument("--environment-args", action="append", metavar="JSON",
                   help="A JSON object configuring an --environment, one per --environment in order when given "
                        "('{}' for none): an OpenEnv environment's settings, reasoning-gym dataset configs "
                        "{\"<dataset>\": {...}}, a verifiers EnvConfig {\"taskset\": {...}, \"agent\": {...}} "
                        "(default: %(default)s).")
    g.add_argument("--environment-eval-size", type=int,
                   help="Prompts per environment in its own eval set (eval/<environment>/..., every "
                        "--eval-interval rollouts); 0: no environment eval sets (default: %(default)s).")
    g.add_argument("--reasoning-gym-size", type=int,
                   help="Training entries generated per reasoning-gym dataset (default: %(default)s).")
    g.add_argument("--reasoning-gym-seed", type=int, help="Seed of reasoning-gym's generators (default: --seed).")
    g.add_argument("--reasoning-gym-weights", type=float, nargs="+",
                   help="Weight of each dataset of a reasoning_gym:<d1>,<d2>,... spec within that environment's "
                        "weight (default: equal).")
    g.add_argument("--reasoning-gym-system-prompt",
                   help="System prompt of reasoning-gym prompts: a key of reasoning_gym.utils.SYSTEM_PROMPTS "
                        "(default, DeepSeekZero, simple, direct, ...) or none (default: %(default)s).")
    g.add_argument("--verifiers-python",
                   help="Python of the venv holding verifiers 0.4.0 (and the environments it loads), where vime runs "
                        "a verifiers:... environment's bridge process; verifiers cannot share vime's venv "
                        "(default: None = .venv-verifiers/bin/python at the repository root, made by "
                        "scripts/install.sh).")
    apply_defaults(parser, EnvironmentConfig)  # defaults: vime/config


def add_judge_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("judge (a judge or reward model served by the run; vime.environments.judge)")
    g.add_argument("--judge-checkpoint",
                   help="HF checkpoint of a judge model the run serves on engines of its own, never updated; reward "
                        "functions call it through `vime.environments.judge.run_judge()` (an OpenAI-compatible "
                        "base_url and api_key, or its `chat` method) (default: None = no judge).")
    g.add_argument("--judge-num-engines", type=int, help="Engines serving the judge (default: %(default)s).")
    g.add_argument("--judge-max-tokens", type=int,
                   help="Tokens a judge reply may take unless the call says otherwise (default: %(default)s).")
    g.add_argument("--judge-temperature", type=float,
                   help="Sampling temperature of judge calls unless the call says otherwise (default: %(default)s).")
    g.add_argument("--judge-timeout", type=float,
                   help="Seconds one judge call may take; past it the call raises and the sample it scores fails "
                        "(default: %(default)g).")
    g.add_argument("--judge-concurrency", type=int,
                   help="Judge calls in flight at once, over its engines, which batch them (default: %(default)s).")
    apply_defaults(parser, JudgeConfig)  # defaults: vime/config


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
