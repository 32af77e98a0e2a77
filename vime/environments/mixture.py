"""Several environments in one run: loading them from the flags, drawing groups by weight, one eval set each.

    environments = load_environments(args, tokenizer)            # the rollout manager, once
    source = EnvironmentMixSource(environments, tokenizer, args)  # training groups, by weight
    evals = environment_eval_sources(environments, tokenizer, args)
"""

from __future__ import annotations

import importlib
import json
import zlib

from vime.config.agents import EnvironmentConfig
from vime.config.rollout import EvalConfig, PromptDataConfig, RolloutConfig
from vime.data.data_source import RolloutDataSource
from vime.data.sample import Sample
from vime.data.sample_codec import json_ready
from vime.environments.base import ENVIRONMENT_KEY, Environment, EnvironmentSpec, KINDS, parse_spec


def environment_specs(args) -> list[EnvironmentSpec]:
    """The run's `--environment` specs with their `--environment-weights` and `--environment-args` (one each, in
    order, or none)."""
    environments = EnvironmentConfig.of(args)
    texts = list(environments.environment or [])
    if not texts:
        return []
    weights = list(environments.environment_weights or [1.0] * len(texts))
    configs = list(environments.environment_args or ["{}"] * len(texts))
    if len(weights) != len(texts):
        raise ValueError(f"--environment-weights: {len(weights)} weights for {len(texts)} --environment specs; "
                         "give one per --environment, in order")
    if len(configs) != len(texts):
        raise ValueError(f"--environment-args: {len(configs)} JSON objects for {len(texts)} --environment specs; "
                         "give one per --environment, in order ('{}' for none)")
    specs = []
    for text, weight, config in zip(texts, weights, configs):
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"--environment-args for {text}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"--environment-args for {text}: expected a JSON object, got {type(config).__name__}")
        specs.append(parse_spec(text, weight, config))
    return specs


def load_environments(args, specs: list[EnvironmentSpec] | None = None) -> list[Environment]:
    """Build the run's environments (each kind's module imported now, not before); names must be unique."""
    environments: list[Environment] = []
    for spec in environment_specs(args) if specs is None else specs:
        environments += importlib.import_module(KINDS[spec.kind]).load(spec, args)
    names = [e.name for e in environments]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        for env in environments:
            env.close()
        raise ValueError(f"--environment: two environments are named {', '.join(duplicates)}; each needs its own "
                         "name (its samples' tag, metrics and eval set)")
    return environments


class EnvironmentMixSource(RolloutDataSource):
    """`RolloutDataSource`'s interface over several environments' prompts. Each environment keeps its own prompt
    order (epochs, a shuffle seeded by --rollout-seed and its name); each new group comes from the environment
    furthest behind its share (smooth weighted round robin: after any n groups every environment has had within
    one group of n x its normalized weight). Samples carry their environment's name in `metadata[ENVIRONMENT_KEY]`
    (set when its prompts were made); indices run over the whole run. Groups given back are served first."""

    def __init__(self, prompts: dict[str, list[Sample]], weights: dict[str, float], n_samples_per_prompt: int,
                 seed: int, shuffle: bool, buffer_filter=None):
        if not prompts or not all(prompts.values()):
            empty = [name for name, ps in prompts.items() if not ps]
            raise ValueError(f"environments without prompts: {', '.join(empty) or 'none given'}")
        super().__init__([p for ps in prompts.values() for p in ps], n_samples_per_prompt, seed, shuffle,
                         buffer_filter)
        total = sum(weights[name] for name in prompts)
        self.shares = {name: weights[name] / total for name in prompts}
        self.credit = {name: 0.0 for name in prompts}
        self.orders = {name: RolloutDataSource(ps, 1, seed + zlib.crc32(name.encode()), shuffle)
                       for name, ps in prompts.items()}

    def next_environment(self) -> str:
        for name, share in self.shares.items():
            self.credit[name] += share
        name = max(self.credit, key=lambda n: self.credit[n])  # ties: the first named
        self.credit[name] -= 1.0
        return name

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = self.take_buffered(num_groups)
        while len(groups) < num_groups:
            groups.append(self.new_group(self.orders[self.next_environment()].next_prompt()))
        return groups

    def state_dict(self) -> dict:
        return {
            "next_sample_index": self.next_sample_index,
            "next_group_index": self.next_group_index,
            "credit": dict(self.credit),
            "environments": {name: {"epoch": o.epoch, "offset": o.offset} for name, o in self.orders.items()},
            "buffer": [[json_ready(s.to_dict()) for s in g] for g in self.buffer],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` left off; an environment the state does not know starts at its beginning."""
        self.next_sample_index = state["next_sample_index"]
        self.next_group_index = state["next_group_index"]
        self.credit.update({k: v for k, v in (state.get("credit") or {}).items() if k in self.credit})
        self.buffer = [[Sample.from_dict(d) for d in g] for g in state.get("buffer", [])]
        for name, position in (state.get("environments") or {}).items():
            if name in self.orders:
                order = self.orders[name]
                order.load_state_dict({**order.state_dict(), **position})


def environment_source(environments: list[Environment], tokenizer, args, buffer_filter=None) -> EnvironmentMixSource:
    rollout = RolloutConfig.of(args)
    prompt_data = PromptDataConfig.of(args)
    prompts = {env.name: env.train_prompts(tokenizer, args) for env in environments}
    return EnvironmentMixSource(prompts, {env.name: env.weight for env in environments}, rollout.n_samples_per_prompt,
                                rollout.rollout_seed, prompt_data.rollout_shuffle, buffer_filter)


def environment_eval_sources(environments: list[Environment], tokenizer, args) -> dict[str, RolloutDataSource]:
    """One eval set per environment, named after it, of --environment-eval-size prompts (none when 0)."""
    environments_flags = EnvironmentConfig.of(args)
    evaluation = EvalConfig.of(args)
    rollout = RolloutConfig.of(args)
    n = environments_flags.environment_eval_size or 0
    if n <= 0:
        return {}
    return {env.name: RolloutDataSource(env.eval_prompts(tokenizer, args, n), evaluation.n_samples_per_eval_prompt,
                                        rollout.rollout_seed, shuffle=False) for env in environments}


def sample_environment(environments: dict[str, Environment], sample: Sample) -> Environment:
    name = sample.metadata.get(ENVIRONMENT_KEY)
    env = environments.get(name)
    if env is None:
        raise KeyError(f"sample {sample.index} is tagged with environment {name!r}, which this run does not have "
                       f"({', '.join(environments) or 'none'})")
    return env
