"""vime's rollout-side flags (data, sampling, engines, fault tolerance, the data buffer, rewards, filters, eval,
debug) and their validation (`validate_rollout_args`). Names follow slime."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from vime.config.agents import EnvironmentConfig
from vime.config.rollout import (
    DataBufferConfig,
    EnginesConfig,
    EvalConfig,
    FaultToleranceConfig,
    PromptDataConfig,
    RewardConfig,
    RolloutConfig,
)
from vime.config.run import DebugConfig, JobConfig
from vime.config.section import add_flags
from vime.rollout.rm_hub import RM_REGISTRY
from vime.utils.lora_adapters import AdapterSpec, adapter_specs
from vime.utils.misc import with_values

DEFAULT_GENERATE_FUNCTION = "vime.rollout.vllm_rollout.generate"
_FUNCTION_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")  # pkg.module.fn


def add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prompt data")
    add_flags(g, PromptDataConfig)


def add_rollout_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout")
    add_flags(g, RolloutConfig)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout engines")
    add_flags(g, EnginesConfig)


def add_fault_tolerance_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault tolerance")
    add_flags(g, FaultToleranceConfig)


def add_buffer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data buffer")
    add_flags(g, DataBufferConfig)


def add_reward_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rewards")
    add_flags(g, RewardConfig)


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation")
    add_flags(g, EvalConfig)


def add_debug_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debugging")
    add_flags(g, DebugConfig)


def add_all_rollout_args(parser: argparse.ArgumentParser) -> None:
    for add in (add_data_args, add_rollout_args, add_engine_args, add_fault_tolerance_args, add_buffer_args,
                add_reward_args, add_eval_args, add_debug_args):
        add(parser)


def validate_adapter_rms(args: argparse.Namespace, adapters: list[AdapterSpec]) -> None:
    """Each adapter's own RM (--lora-adapters NAME=PROMPT_DATA:RM) is an --rm-type name or a function path (loaded
    with the other function paths, `vime.arguments.function_path_flags`); --group-rm takes none of them."""
    rewards = RewardConfig.of(args)
    with_rm = [s for s in adapters if s.rm]
    for spec in with_rm:
        if spec.rm not in RM_REGISTRY and not _FUNCTION_PATH.match(spec.rm):
            raise ValueError(f"--lora-adapters {spec.name}: RM {spec.rm!r} is neither an --rm-type name "
                             f"({', '.join(sorted(RM_REGISTRY))}) nor a function path pkg.module.fn")
    if with_rm and rewards.group_rm:
        raise ValueError(f"--group-rm scores whole groups with --custom-rm-path; --lora-adapters "
                         f"{', '.join(s.name for s in with_rm)} name RMs of their own, which score one sample: drop "
                         "--group-rm or those RMs")


def validate_rollout_args(args: argparse.Namespace) -> argparse.Namespace:
    """The rollout side's flags (data, sampling, engines, fault tolerance, the data buffer, rewards, eval, debug):
    bad values and combinations rejected with how to fix them; returns a copy of `args` with the derived
    defaults filled in."""
    debug = DebugConfig.of(args)
    rollout = RolloutConfig.of(args)
    prompt_data = PromptDataConfig.of(args)
    environments = EnvironmentConfig.of(args)
    rewards = RewardConfig.of(args)
    evaluation = EvalConfig.of(args)
    engines = EnginesConfig.of(args)
    fault_tolerance = FaultToleranceConfig.of(args)
    data_buffer = DataBufferConfig.of(args)
    job = JobConfig.of(args)
    for section in (debug, rollout, engines, fault_tolerance, evaluation):
        section.check()
    derived = {}
    replaying = debug.load_debug_rollout_data is not None
    engine_free_rollout = rollout.rollout_function_path != RolloutConfig().rollout_function_path  # e.g. sft_rollout
    if debug.debug_train_only and not replaying and not engine_free_rollout:
        raise ValueError("--debug-train-only needs --load-debug-rollout-data PATH_{rollout_id}, or a "
                         "--rollout-function-path that needs no engines (vime.rollout.sft_rollout.generate_rollout)")

    adapters = adapter_specs(args)
    if not replaying:
        if not prompt_data.prompt_data and not adapters and not environments.environment:
            raise ValueError("--prompt-data FILE is required (JSONL or Parquet; with --lora-adapters, each adapter's "
                             "NAME=FILE) unless replaying saved rollouts")
        if prompt_data.prompt_data and not Path(prompt_data.prompt_data).is_file():
            raise ValueError(f"--prompt-data {prompt_data.prompt_data}: file not found")
        unscored = [s.name for s in adapters if s.rm is None]
        if rewards.rm_type is None and rewards.custom_rm_path is None and not debug.debug_train_only \
                and (unscored or not adapters):
            raise ValueError("choose a reward: --rm-type (math, boxed, f1, ...) or --custom-rm-path module.fn"
                             + (f" (for --lora-adapters {', '.join(unscored)}, which name no RM of their own)"
                                if adapters else ""))
        if not rewards.rm_url and "remote_rm" in [rewards.rm_type] + [s.rm for s in adapters]:
            raise ValueError("--rm-type remote_rm needs --rm-url http://host:port/path")
    validate_adapter_rms(args, adapters)
    if evaluation.eval_prompt_data is not None:
        for name, path in zip(evaluation.eval_prompt_data[::2], evaluation.eval_prompt_data[1::2]):
            if not Path(path).is_file():
                raise ValueError(f"--eval-prompt-data {name}: file {path} not found")
            if adapters and name not in [s.name for s in adapters]:
                raise ValueError(f"--eval-prompt-data {name}: a multi-LoRA run evaluates each eval set with the "
                                 "adapter it is named after; name it after the adapter it evaluates (one of "
                                 f"{', '.join(s.name for s in adapters)})")

    if evaluation.eval_pass_at_k is not None:
        if evaluation.eval_prompt_data is None and not environments.environment_eval_size:
            raise ValueError("--eval-pass-at-k needs eval sets: --eval-prompt-data NAME PATH (or "
                             "--environment-eval-size N)")

    if rollout.over_sampling_batch_size is None:
        derived["over_sampling_batch_size"] = rollout.rollout_batch_size
    if fault_tolerance.use_fault_tolerance and engines.rollout_external_engine_addrs:
        raise ValueError("--use-fault-tolerance restarts engines vime started; it cannot restart "
                         "--rollout-external-engine-addrs servers (drop one of the two)")
    derived["rollout_data_dir"] = os.path.abspath(data_buffer.rollout_data_dir or
                                                  os.path.join(os.path.abspath(job.output_dir), "rollout_data"))

    if rollout.rollout_seed is None:
        derived["rollout_seed"] = job.seed
    if isinstance(prompt_data.apply_chat_template_kwargs, str):
        try:
            derived["apply_chat_template_kwargs"] = json.loads(prompt_data.apply_chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--apply-chat-template-kwargs is not valid JSON: {e}") from e
    for name, default in (("eval_temperature", rollout.rollout_temperature), ("eval_top_p", rollout.rollout_top_p),
                          ("eval_top_k", rollout.rollout_top_k),
                          ("eval_max_response_len", rollout.rollout_max_response_len)):
        if getattr(evaluation, name) is None:
            derived[name] = default
    return with_values(args, **derived)
