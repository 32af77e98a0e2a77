"""Multi-LoRA: several named adapters on one base, each with its own prompts and reward (--lora-adapters).

    --lora-adapters math=data/math.jsonl:math code=data/code.jsonl:my_pkg.rewards.tests_pass

Each entry is NAME=PROMPT_DATA[:RM]: RM is an --rm-type name or a function path (`pkg.mod.fn`, the signature of
--custom-rm-path); without it the run's --rm-type / --custom-rm-path scores the adapter's samples. Every sample
carries its adapter's name in `metadata[ADAPTER_KEY]` (`vime.data.sample`): the rollout asks the engines for the model of that name,
the reward is the adapter's, the trainer computes the sample's tokens through that adapter. A run without the
flag trains one adapter (--lora-rank) served as the policy itself.

Read by every layer (rollout data and rewards, engine flags, trainer, weight sync), so it lives at the bottom.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from vime.config.train import LoraConfig

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class AdapterSpec(NamedTuple):
    name: str
    prompt_data: str
    rm: str | None  # an --rm-type name or a reward function path; None: the run's reward


def parse_adapter_spec(text: str) -> AdapterSpec:
    """One --lora-adapters entry, NAME=PROMPT_DATA[:RM]."""
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise ValueError(f"--lora-adapters {text!r}: expected NAME=PROMPT_DATA[:RM]")
    if not _NAME.match(name):
        raise ValueError(f"--lora-adapters {text!r}: adapter name {name!r} must be 1-64 letters, digits, '_', '.' or "
                         "'-', starting with a letter or digit (it is the model name requests ask the engines for)")
    path, sep, rm = rest.rpartition(":")
    if not sep or not rm or "/" in rm:  # no RM; a ':' inside a path is left to the path
        path, rm = rest, None
    return AdapterSpec(name, path, rm)


def adapter_specs(args) -> list[AdapterSpec]:
    """The run's --lora-adapters in order ([] without the flag). Raises on a malformed entry or a repeated name."""
    lora = LoraConfig.of(args)
    specs = [parse_adapter_spec(text) for text in lora.lora_adapters or []]
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--lora-adapters: adapter name(s) {', '.join(repeated)} given more than once")
    return specs


def adapter_names(args) -> list[str]:
    return [s.name for s in adapter_specs(args)]
