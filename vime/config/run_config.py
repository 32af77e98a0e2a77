"""`RunConfig`: every flag of a run in typed, frozen sections, built once at the entry point from the parsed command
line (`vime.arguments.parse_args`), each value checked against its field's type.

The Megatron-core and vLLM pass-through groups (hundreds of flags generated from megatron-core's dataclasses and
mirrored from vLLM's own parser) are opaque sections (`PassThrough`): vime forwards them and reads few of them.
`namespace()` is the flat, slime-style view of the same values that custom functions receive as `args`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

from vime.config.agents import AgentConfig, EnvironmentConfig, HarnessConfig, JudgeConfig
from vime.config.algorithm import AlgorithmConfig, DistillationConfig, RolloutCorrectionConfig
from vime.config.rollout import (
    DataBufferConfig,
    EnginesConfig,
    EvalConfig,
    FaultToleranceConfig,
    PromptDataConfig,
    RewardConfig,
    RolloutConfig,
)
from vime.config.router import RouterConfig
from vime.config.run import DebugConfig, JobConfig, PlacementConfig, WandbConfig
from vime.config.section import DERIVED, Section, check_types
from vime.config.train import LoraConfig, MegatronConfig, RoutingReplayConfig, TrainLoopConfig, WeightSyncConfig


@dataclasses.dataclass(frozen=True)
class PassThrough:
    """Flags vime forwards to a library as they are (megatron-core's config fields, vLLM's engine arguments)."""

    values: dict[str, Any]

    def __repr__(self) -> str:
        return f"PassThrough({len(self.values)} values)"

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run's flags, by the component that owns them."""

    job: JobConfig
    wandb: WandbConfig
    placement: PlacementConfig
    debug: DebugConfig
    prompt_data: PromptDataConfig
    rollout: RolloutConfig
    engines: EnginesConfig
    fault_tolerance: FaultToleranceConfig
    data_buffer: DataBufferConfig
    rewards: RewardConfig
    eval: EvalConfig
    megatron: MegatronConfig
    train: TrainLoopConfig
    weight_sync: WeightSyncConfig
    lora: LoraConfig
    routing_replay: RoutingReplayConfig
    algorithm: AlgorithmConfig
    rollout_correction: RolloutCorrectionConfig
    distillation: DistillationConfig
    router: RouterConfig
    agents: AgentConfig
    harness: HarnessConfig
    environments: EnvironmentConfig
    judge: JudgeConfig
    megatron_core: PassThrough  # megatron-core's TransformerConfig / OptimizerConfig / DDP fields, generated
    vllm: PassThrough  # vLLM's engine arguments, mirrored as --vllm-*
    router_cli: PassThrough  # vllm-router's other options, mirrored as --router-*
    runtime: PassThrough  # what the run adds to a slime-style `args` as it goes (not flags)

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        """{field: section class} of the typed sections."""
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        return {name: SECTIONS[hint] for name, hint in hints.items() if hint in SECTIONS}

    @classmethod
    def build(cls, args: argparse.Namespace, megatron_core: Iterable[str], vllm: Iterable[str],
              router_cli: Iterable[str], runtime: Iterable[str] = ()) -> RunConfig:
        """The typed config of a parsed, validated `args`. `megatron_core`, `vllm`, `router_cli`: the destinations
        of those pass-through groups; `runtime`: entries the run added that are no flags. Raises TypeError naming
        each value of the wrong type, or each entry of `args` that no section owns."""
        values = vars(args)
        sections = {name: section.of(args) for name, section in cls.sections().items()}
        for section in sections.values():
            check_types(section)
        owned = {f.name for s in sections.values() for f in dataclasses.fields(s)}
        opaque = {"megatron_core": set(megatron_core), "vllm": set(vllm), "router_cli": set(router_cli) - owned,
                  "runtime": set(runtime)}
        unowned = sorted(set(values) - owned - set().union(*opaque.values()))
        if unowned:
            raise TypeError(f"no config section owns {', '.join(unowned)}: add each to the section of the component "
                            "that reads it (vime/config/)")
        passed = {name: PassThrough({d: values[d] for d in dests if d in values})
                  for name, dests in opaque.items()}
        return cls(**sections, **passed)

    def namespace(self, **extra: Any) -> argparse.Namespace:
        """The flat, slime-style `args` of this config (every flag under its destination), with `extra` set."""
        flat: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            section = getattr(self, field.name)
            if isinstance(section, PassThrough):
                flat.update(section.values)
                continue
            for f in dataclasses.fields(section):  # a derived value no validation set is not on a parsed `args`
                if not (f.metadata.get(DERIVED) and getattr(section, f.name) is None):
                    flat[f.name] = copy.deepcopy(getattr(section, f.name))  # the config's lists stay its own
        return argparse.Namespace(**flat, **extra)


SECTIONS: dict[str, type[Section]] = {cls.__name__: cls for cls in (
    JobConfig, WandbConfig, PlacementConfig, DebugConfig, PromptDataConfig, RolloutConfig, EnginesConfig,
    FaultToleranceConfig, DataBufferConfig, RewardConfig, EvalConfig, MegatronConfig, TrainLoopConfig,
    WeightSyncConfig, LoraConfig, RoutingReplayConfig, AlgorithmConfig, RolloutCorrectionConfig, DistillationConfig,
    RouterConfig, AgentConfig, HarnessConfig, EnvironmentConfig, JudgeConfig)}
