"""vime's command line: three groups of flags in one parser, a YAML config, and validation.

- Megatron-style training flags (`vime.trainer.megatron.arguments`), same names as Megatron-LM (the
  megatron-core package ships no parser of its own), plus how a rollout becomes optimizer steps
  (`train_arguments`) and the RL algorithm (`vime.algorithms.arguments`).
- vLLM engine flags mirrored from vLLM's own parser as `--vllm-*`, router flags as `--router-*`
  (`vime.engine.control.arguments`).
- vime's own flags: placement and run control here; rollout, data, rewards, eval, fault tolerance and the
  data buffer in `vime.rollout.arguments`; agents (multi-turn tools, the OpenAI-compatible harness) in
  `vime.agents.arguments` and `vime.agents.openai_arguments`; environments (reasoning-gym, OpenEnv) and the judge in
  `vime.environments.arguments`.

Everything is checked before any process starts (`validate_args`).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from pathlib import Path

import yaml

from vime.agents.arguments import add_agent_args
from vime.agents.openai_arguments import add_agent_harness_args
from vime.algorithms.arguments import add_algorithm_args, validate_algorithm_args
from vime.trainer.megatron.arguments import add_megatron_args
from vime.trainer.megatron.megatron_flags import add_generated_megatron_args
from vime.trainer.megatron.routing_replay_arguments import (add_routing_replay_args, rollout_replay_on_devices,
                                                                   validate_routing_replay_args)
from vime.config import RunConfig
from vime.config.rollout import EnginesConfig
from vime.config.run import DebugConfig, JobConfig, PlacementConfig, WandbConfig
from vime.config.section import add_flags, apply_defaults
from vime.config.train import LoraConfig, MegatronConfig, WeightSyncConfig
from vime.engine.control.arguments import (VLLM_RAW_DEST, add_router_args, add_vllm_engine_args,
                                           check_engines_can_serve, validate_vllm_args)
from vime.engine.control.engine import hf_config_json
from vime.engine.control.sglang_flags import SGLangFlagError, translate_sglang_flags
from vime.environments.arguments import add_environment_args, add_judge_args, validate_environment_args
from vime.rollout.arguments import add_all_rollout_args, validate_rollout_args
from vime.rollout.rm_hub import RM_REGISTRY
from vime.trainer.megatron.train_arguments import add_train_args, lora_sync_on_devices, validate_train_args
from vime.utils.lora_adapters import adapter_specs

logger = logging.getLogger(__name__)


def add_run_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run")
    add_flags(g, JobConfig)


def add_wandb_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("wandb", "Weights & Biases logging, beside metrics.jsonl and TensorBoard.")
    add_flags(g, WandbConfig)


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("placement")
    add_flags(g, PlacementConfig)


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="vime: RL post-training with vLLM rollout and Megatron-core training.",
        allow_abbrev=False,
    )
    add_run_args(parser)
    add_wandb_args(parser)
    add_placement_args(parser)
    add_all_rollout_args(parser)
    add_megatron_args(parser)
    add_train_args(parser)
    add_routing_replay_args(parser)
    add_algorithm_args(parser)
    add_vllm_engine_args(parser)
    add_router_args(parser)
    add_agent_args(parser)
    add_environment_args(parser)
    add_judge_args(parser)
    add_agent_harness_args(parser)
    apply_defaults(parser, *RunConfig.sections().values())  # the defaults live with the typed sections
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


def run_config(args: argparse.Namespace) -> RunConfig:
    """The typed, frozen config of validated `args`; raises ValueError naming each value of a wrong type."""
    try:
        return RunConfig.build(args, megatron_core=_dests(add_generated_megatron_args),
                               vllm=(*_dests(add_vllm_engine_args), VLLM_RAW_DEST), router_cli=_dests(add_router_args))
    except TypeError as e:
        raise ValueError(str(e)) from e


@functools.cache
def _dests(add_flags) -> frozenset[str]:
    """The destinations of the flags `add_flags` adds (a pass-through group's, for `run_config`)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    return frozenset(action.dest for action in parser._actions)


def config_to_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """Turn a YAML mapping {flag: value} into command-line tokens (placed before the real ones). A value equal to
    the flag's default needs no tokens (also for defaults no command line can spell, e.g. an empty list); false
    gives a flag's --no- form where it has one; a list gives a repeated flag its values one at a time."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    actions = {opt: action for action in parser._actions for opt in action.option_strings}
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if flag not in actions:
            raise ValueError(f"--config {path}: unknown flag {key!r} (as {flag})")
        action = actions[flag]
        if value is None or value == parser.get_default(action.dest):
            continue
        if value is False:
            if "--no-" + flag[2:] in actions:
                argv.append("--no-" + flag[2:])
        elif value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)) and isinstance(action, argparse._AppendAction):
            for item in value:
                argv += [flag, *map(str, item if isinstance(item, (list, tuple)) else [item])]
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv.append(f"{flag}={json.dumps(value)}")
        else:
            argv.append(f"{flag}={value}")  # one token: a value that starts with "-" is not read as a flag
    return argv


def parse_args(argv: list[str] | None = None, extra_args_provider=None, validate: bool = True,
               check_model: bool = True) -> argparse.Namespace:
    """The run's flags, validated (`validate`), the model's architecture and parallel layout included
    (`check_model`: transformers reads the checkpoint's config, ~3 s of imports; a run's driver does it in
    `TrainingSession` instead, while Ray starts)."""
    parser = build_parser(extra_args_provider)
    argv = list(sys.argv[1:] if argv is None else argv)
    config = _find_config(argv)
    if config:
        try:
            argv = config_to_argv(config, parser) + argv
        except ValueError as e:
            parser.error(str(e))
    try:  # a slime script's SGLang engine flags: vLLM's equivalents, or a refusal naming them
        argv, notices = translate_sglang_flags(argv)
    except SGLangFlagError as e:
        parser.error(str(e))
    for notice in notices:
        logger.warning("slime's SGLang flag: %s", notice)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(unknown_flags_message(unknown, parser))
    if validate:
        try:
            args = validate_args(args, check_model=check_model)
        except ValueError as e:
            parser.error(str(e))
    return args


def unknown_flags_message(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """Each unknown flag with the closest known names (a Megatron-LM, slime or vLLM spelling is often one
    dash-word away from vime's)."""
    import difflib

    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    lines = []
    for token in unknown:
        if not token.startswith("-"):
            lines.append(f"{token!r} (a value with no flag before it)")
            continue
        flag = token.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
        lines.append(f"{flag}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return "unrecognized arguments: " + "; ".join(lines) + " (train.py --help lists every flag)"


def _find_config(argv: list[str]) -> str | None:
    for i, tok in enumerate(argv):
        if tok == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith("--config="):
            return tok.split("=", 1)[1]
    return None


def function_path_flags(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, path) of every function path given: each of vime's flags named `*_path` or `*_paths` (the
    extension seam, resolved by `load_function`), and the reward functions --lora-adapters names (an RM that is no
    --rm-type name); vLLM's and the router's flags name files, not functions, and megatron-core's fields
    (`--use-mamba-mem-eff-path`) are not paths at all."""
    from vime.trainer.megatron.megatron_flags import generated_dests

    megatron = generated_dests()
    given = []
    for flag, value in sorted(vars(args).items()):
        if flag.startswith(("vllm_", "router_")) or not flag.endswith(("_path", "_paths")) or not value \
                or flag in megatron:
            continue
        given += [(flag, path) for path in (value if isinstance(value, (list, tuple)) else [value])]
    given += [("lora_adapters", s.rm) for s in adapter_specs(args) if s.rm and s.rm not in RM_REGISTRY]
    return given


def validate_transport_placement(args: argparse.Namespace, gpus: bool | None = None) -> None:
    """Weight transports that cannot work with the engines' placement, refused before anything starts. `gpus`:
    whether the run's actors compute on GPUs, as the cluster's resources say once Ray is up
    (`vime.utils.device.cluster_has_gpus`); the driver may run on a CPU-only head node, so its own devices do not tell.
    None (while parsing the flags): only what holds on any device."""
    weight_sync = WeightSyncConfig.of(args)
    placement = PlacementConfig.of(args)
    engines = EnginesConfig.of(args)
    rollout_replay_on_devices(args, gpus)
    lora_sync_on_devices(args, gpus)
    kind = weight_sync.update_weight_transport
    if kind == "cuda_ipc":
        if gpus is False:
            raise ValueError("--update-weight-transport cuda_ipc needs GPUs; use disk or broadcast on CPU")
        if not placement.colocate:
            raise ValueError("--update-weight-transport cuda_ipc maps the trainer's GPU tensors into engines on the "
                             "same GPUs: add --colocate, or use broadcast (or disk) for engines on their own GPUs")
        if engines.rollout_num_gpus_per_engine > 1:
            raise ValueError("--update-weight-transport cuda_ipc serves engines of one GPU; with "
                             f"--rollout-num-gpus-per-engine {engines.rollout_num_gpus_per_engine} use disk or "
                             "broadcast")
    if kind == "broadcast" and placement.colocate and gpus:
        raise ValueError("--update-weight-transport broadcast with --colocate would put a trainer rank and an engine "
                         "on one GPU into one NCCL group, which NCCL refuses; use cuda_ipc (or disk) with --colocate")


def validate_wandb_args(args: argparse.Namespace) -> argparse.Namespace:
    """--wandb-* flags need --use-wandb; fills --wandb-dir (<output-dir>/wandb when unset)."""
    from vime.utils.misc import with_values

    wandb, job = WandbConfig.of(args), JobConfig.of(args)
    wandb.check()
    if not wandb.use_wandb:
        return args
    if wandb.wandb_key:
        logger.warning("--wandb-key: the key is on the command line, which every user of this node can read (ps); "
                       "vime hands it to wandb in this process only and never writes it, but prefer WANDB_API_KEY "
                       "in the environment or `wandb login`")
    return with_values(args, wandb_dir=os.path.abspath(wandb.wandb_dir or os.path.join(job.output_dir, "wandb")))


def validate_args(args: argparse.Namespace, check_model: bool = True) -> argparse.Namespace:
    """Reject bad combinations with a message that says how to fix them: the run's and the placement's flags
    here, each package's own next to where it declares them, then every function path, then (`check_model`)
    the model's. Returns a copy of `args` with every derived default filled in (the only place the run's flags
    are written)."""
    from vime.utils.misc import load_function, with_values

    job = JobConfig.of(args)
    if not job.hf_checkpoint:
        raise ValueError("--hf-checkpoint DIR is required (build a tiny one: python -m vime.synthetic.tiny_model)")
    if not (Path(job.hf_checkpoint) / "config.json").is_file():
        raise ValueError(f"--hf-checkpoint {job.hf_checkpoint}: no config.json there; is it an HF checkpoint?")
    args = with_values(args, output_dir=os.path.abspath(job.output_dir))
    if job.control_token_file:
        from vime.utils.auth import read_token_file

        read_token_file(job.control_token_file)  # unreadable, short or readable by others: say so now
    job.check()
    PlacementConfig.of(args).check()
    args = validate_wandb_args(args)
    validate_transport_placement(args)
    args = validate_environment_args(args)  # sets the reward (and generate) hooks the rollout side checks
    args = validate_rollout_args(args)
    for flag, path in function_path_flags(args):
        try:
            load_function(path)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"--{flag.replace('_', '-')}: {e}") from e
    validate_vllm_args(args)
    args = validate_algorithm_args(args)
    args = validate_train_args(args)
    validate_routing_replay_args(args)
    run_config(args)  # every value of its field's type
    if check_model:
        check_model_args(args)
    return args


class ArgumentsError(ValueError):
    """Flags found unrunnable after parsing (the model check a run's driver does while Ray starts); reported as
    a parse error."""


def check_model_args(args: argparse.Namespace) -> None:
    """The model and its parallel layout against the checkpoint's config (before any engine or trainer starts).
    Raises ValueError naming what is wrong."""
    debug = DebugConfig.of(args)
    job = JobConfig.of(args)
    placement = PlacementConfig.of(args)
    if not debug.debug_train_only and not EnginesConfig.of(args).rollout_external_engine_addrs:
        check_engines_can_serve(args, hf_config_json(job.hf_checkpoint))
    if debug.debug_rollout_only:  # no trainer: the engines read the checkpoint themselves
        return
    from transformers import AutoConfig

    from vime.trainer.megatron.arguments import fill_architecture_from_hf, validate_megatron_args

    try:
        hf_config = AutoConfig.from_pretrained(job.hf_checkpoint)
    except Exception as e:  # transformers' own checks raise KeyError, ValueError, OSError, ...
        raise ValueError(f"--hf-checkpoint {job.hf_checkpoint}: transformers cannot read its config.json "
                         f"({type(e).__name__}: {e})") from e
    world_size = placement.actor_num_nodes * placement.actor_num_gpus_per_node
    filled = fill_architecture_from_hf(args, hf_config)
    validate_megatron_args(filled, world_size=world_size)  # each rank fills its own architecture again
    if LoraConfig.of(args).lora_rank and MegatronConfig.of(filled).linear_attention_freq:
        raise ValueError(f"--lora-rank on {hf_config.model_type}: LoRA adapters for its Gated DeltaNet projections "
                         "and its gated attention (q_proj holds the output gate) are not supported yet; train the "
                         "whole model (drop --lora-rank)")
