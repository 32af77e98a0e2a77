"""What every environment kind provides, the `--environment` spec, and the optional-import rule.

An `Environment` is one named source of prompts with its own scoring (and, for multi-turn kinds, its own
generation). Kinds are registered in `KINDS` by module path and imported only when a spec names them (verifiers' module
imports no verifiers: that runs in its own venv).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from vime.config.rollout import PromptDataConfig
from vime.data.sample import Sample
from vime.rollout.metrics import ENVIRONMENT_KEY, REWARD_FUNCTIONS_KEY, REWARD_WEIGHTS_KEY

__all__ = ["ENVIRONMENT_KEY", "REWARD_FUNCTIONS_KEY", "REWARD_WEIGHTS_KEY", "Environment", "EnvironmentSpec",
           "KINDS", "MissingExtraError", "import_optional", "parse_spec"]

# kind -> module whose `load(spec, args) -> list[Environment]` builds it (imported only when used)
KINDS = {
    "reasoning_gym": "vime.environments.reasoning_gym_env",
    "openenv": "vime.environments.openenv_env",
    "verifiers": "vime.environments.verifiers_env",  # runs in its own venv, through a bridge process
}


class MissingExtraError(ImportError):
    """An environment kind's library is not installed."""


def import_optional(module: str, kind: str, package: str):
    """Import `module` of the optional library behind `--environment kind:...`, or raise a one-line error naming
    the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"--environment {kind}:... needs the {package} package, which is not installed "
                                f"({e.msg}): pip install -e '.[envs]'") from None


@dataclasses.dataclass(frozen=True)
class EnvironmentSpec:
    """One `--environment KIND:TARGET`, its weight in the mixture and its `--environment-args` (a JSON object)."""

    kind: str
    target: str
    weight: float = 1.0
    config: dict[str, Any] = dataclasses.field(default_factory=dict)


def parse_spec(text: str, weight: float = 1.0, config: dict[str, Any] | None = None) -> EnvironmentSpec:
    kind, sep, target = text.partition(":")
    if not sep or not target:
        raise ValueError(f"--environment {text!r}: expected KIND:TARGET with KIND one of {', '.join(KINDS)}")
    if kind not in KINDS:
        raise ValueError(f"--environment {text!r}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    if not weight > 0:
        raise ValueError(f"--environment {text!r}: weight must be > 0, got {weight}")
    return EnvironmentSpec(kind, target, float(weight), dict(config or {}))


class Environment:
    """One environment of a run. Subclasses set `name` (unique in the run; the tag of its samples and the name of
    its metrics and eval set) and `weight`, and implement the methods below.

    - `train_prompts(tokenizer, args)` / `eval_prompts(tokenizer, args, n)`: prompt `Sample`s (tokens, label,
      metadata tagged with `ENVIRONMENT_KEY`); eval ones never among the training ones where the library can say.
    - `async score(args, sample) -> float`: the sample's reward; writes each reward function's value and weight
      into `metadata[REWARD_FUNCTIONS_KEY]` / `[REWARD_WEIGHTS_KEY]`. Raising fails the sample (stage reward).
    - `async score_group(args, samples) -> list[float]`: a group's rewards when rewards need the whole group;
      the default scores each sample on its own. `group_scoring` says whether the run must use it.
    - `generate`: None for single-turn text (vime's own generate), else `async (args, sample, params) -> Sample`.
    - `close()`: stop what the environment started (servers, clients).
    """

    name: str = ""
    weight: float = 1.0
    group_scoring: bool = False
    generate = None

    def train_prompts(self, tokenizer, args) -> list[Sample]:
        raise NotImplementedError

    def eval_prompts(self, tokenizer, args, n: int) -> list[Sample]:
        raise NotImplementedError

    async def score(self, args, sample: Sample) -> float:
        raise NotImplementedError

    async def score_group(self, args, samples: list[Sample]) -> list[float]:
        return [await self.score(args, s) for s in samples]

    def close(self) -> None:
        pass


def record_functions(sample: Sample, values: dict[str, float], weights: dict[str, float]) -> None:
    """Each reward function's value and weight, on the sample (the metrics read them)."""
    sample.metadata[REWARD_FUNCTIONS_KEY] = {k: float(v) for k, v in values.items()}
    sample.metadata[REWARD_WEIGHTS_KEY] = {k: float(v) for k, v in weights.items()}


def prompt_sample(prompt: str | list[dict[str, Any]], tokenizer, args, *, environment: str, label: Any = None,
                  metadata: dict[str, Any] | None = None, where: str = "") -> Sample:
    """A prompt `Sample` built as a prompt file's row is (`row_to_sample`: --apply-chat-template and its kwargs),
    tagged with its environment."""
    prompt_data = PromptDataConfig.of(args)
    import argparse

    from vime.data.prompt_dataset import row_to_sample

    view = argparse.Namespace(input_key="prompt", label_key="label", metadata_key="metadata", tool_key=None,
                              apply_chat_template=prompt_data.apply_chat_template,
                              apply_chat_template_kwargs=prompt_data.apply_chat_template_kwargs)
    row = {"prompt": prompt, "label": label, "metadata": {**(metadata or {}), ENVIRONMENT_KEY: environment}}
    return row_to_sample(row, where or f"environment {environment}", tokenizer, view)
