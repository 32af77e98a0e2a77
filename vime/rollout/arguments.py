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
from vime.config.section import add_flags, apply_defaults
from vime.rollout.rm_hub import RM_REGISTRY
from vime.utils.lora_adapters import AdapterSpec, adapter_specs
from vime.utils.misc import with_values

DEFAULT_GENERATE_FUNCTION = "vime.rollout.vllm_rollout.generate"
_FUNCTION_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")  # pkg.module.fn


def add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prompt data")
    g.add_argument("--prompt-data", help="JSONL or Parquet file of prompts (default: %(default)s).")
    g.add_argument("--input-key",
                   help="Row field holding the prompt: a string, or a list of chat messages (default: %(default)s).")
    g.add_argument("--label-key", help="Row field holding the reference answer (default: %(default)s).")
    g.add_argument("--metadata-key",
                   help="Row field (a dict) copied into Sample.metadata when present (default: %(default)s).")
    g.add_argument("--tool-key", help="Row field with tool schemas passed to the chat template (default: %(default)s).")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="Format prompts with the tokenizer's chat template (default: off).")
    g.add_argument("--apply-chat-template-kwargs", type=str,
                   help="JSON dict of extra keyword arguments for apply_chat_template (default: %(default)s).")
    g.add_argument("--rollout-max-prompt-len", type=int,
                   help="Drop prompts longer than this many tokens when loading (default: no limit).")
    g.add_argument("--max-bad-prompt-rows-ratio", type=float,
                   help="Malformed prompt rows (bad JSON, missing --input-key, bad chat messages) are skipped with "
                        "a warning and counted in data/skipped_rows; loading fails when more than this fraction "
                        "of the rows, or all of them, are malformed (default: %(default)s).")
    g.add_argument("--rollout-shuffle", action="store_true",
                   help="Shuffle prompts each epoch, seeded by --rollout-seed and the epoch (default: off).")
    g.add_argument("--num-epoch", type=int,
                   help="Epochs over the prompt data; sets --num-rollout when that is unset (default: %(default)s).")
    apply_defaults(parser, PromptDataConfig)  # defaults: vime/config


def add_rollout_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout")
    g.add_argument("--rollout-function-path",
                   help="generate_rollout(args, rollout_id, data_source, evaluation=False) (default: %(default)s).")
    g.add_argument("--rollout-timeout", type=float,
                   help="Seconds a whole rollout (or eval) may take before the run stops with an error naming the "
                        "rollout function; a function that never returns must not hang the run (default: %(default)g).")
    g.add_argument("--custom-generate-function-path",
                   help="async generate(args, sample, sampling_params) -> Sample, replacing the single-turn "
                        "default: multi-turn, tools, agents (default: %(default)s).")
    g.add_argument("--rollout-batch-size", type=int, help="Prompts (groups) per rollout (default: %(default)s).")
    g.add_argument("--n-samples-per-prompt", type=int,
                   help="Responses sampled per prompt; one group (default: %(default)s).")
    g.add_argument("--over-sampling-batch-size", type=int,
                   help="Groups submitted at a time when dynamic sampling drops some; must be >= "
                        "--rollout-batch-size (default: --rollout-batch-size).")
    g.add_argument("--dynamic-sampling-filter-path",
                   help="filter(args, samples) -> DynamicFilterOutput; groups it rejects are dropped and more "
                        "are generated, e.g. vime.rollout.filter_hub.dynamic_sampling_filters."
                        "check_reward_nonzero_std (default: %(default)s).")
    g.add_argument("--max-dynamic-sampling-rounds", type=int,
                   help="Give up on dynamic sampling after this many passes over --over-sampling-batch-size "
                        "groups without filling the batch (default: %(default)s).")
    g.add_argument("--rollout-temperature", type=float, help="Sampling temperature (default: %(default)s).")
    g.add_argument("--rollout-top-p", type=float, help="Nucleus sampling p (default: %(default)s).")
    g.add_argument("--rollout-top-k", type=int, help="Top-k sampling; -1 disables (default: %(default)s).")
    g.add_argument("--rollout-max-response-len", type=int,
                   help="Maximum new tokens per response (default: %(default)s).")
    g.add_argument("--rollout-stop", nargs="+", help="Stop strings (default: %(default)s).")
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+",
                   help="Stop token ids in addition to EOS (default: %(default)s).")
    g.add_argument("--rollout-seed", type=int,
                   help="Seed for data shuffling and per-request sampling seeds (default: --seed).")
    g.add_argument("--rollout-concurrency", type=int,
                   help="Maximum generate requests in flight across all engines (default: %(default)s).")
    g.add_argument("--rollout-request-timeout", type=float,
                   help="Seconds before one generate request is abandoned and retried (default: %(default)g).")
    g.add_argument("--rollout-request-retries", type=int,
                   help="Retries of a failed generate request before the sample is marked failed "
                        "(default: %(default)s).")
    g.add_argument("--partial-rollout", action="store_true",
                   help="Keep groups cut off when the batch filled (aborted mid-generation) and continue them "
                        "first in the next rollout instead of discarding them (default: off).")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true",
                   help="With --partial-rollout: do not train on the tokens generated before the abort (older "
                        "weights); only the continuation is trained (default: off).")
    g.add_argument("--buffer-filter-path",
                   help="filter(args, buffer, num_groups) -> groups: which kept groups are served next "
                        "(default: vime.rollout.filter_hub.buffer_filters.pop_first, oldest first).")
    g.add_argument("--custom-reward-post-process-path",
                   help="post_process(args, samples) -> None, run on each finished group after rewards, "
                        "e.g. to shape rewards (default: %(default)s).")
    g.add_argument("--data-source-path",
                   help="slime's data source class, made as cls(args): get_samples(num_groups) -> "
                        "list[list[Sample]], add_samples(groups), save(rollout_id) and load(rollout_id) at "
                        "checkpoints, len() (default: None = vime's, over --prompt-data).")
    g.add_argument("--custom-convert-samples-to-train-data-path",
                   help="convert(args, samples) -> dict of per-sample lists (slime's train data: tokens, "
                        "response_lengths, rewards, loss_masks, rollout_log_probs, truncated, ...) in place of the "
                        "default conversion; what it returns is what the trainer trains on (default: %(default)s).")
    g.add_argument("--custom-rollout-log-function-path",
                   help="log(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool, called "
                        "with each rollout's samples; True skips vime's own rollout metrics for it "
                        "(default: %(default)s).")
    apply_defaults(parser, RolloutConfig)  # defaults: vime/config


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout engines")
    g.add_argument("--rollout-num-gpus", type=int,
                   help="Devices for rollout engines; on CPU, the number of engine slots (default: %(default)s).")
    g.add_argument("--rollout-num-gpus-per-engine", type=int,
                   help="Devices per engine (tensor parallel on GPU); 1 on CPU (default: %(default)s).")
    g.add_argument("--rollout-external-engine-addrs", nargs="+",
                   help="host:port of vLLM servers started elsewhere (with --enable-scale-out, processed "
                        "log-probs, VLLM_SERVER_DEV_MODE=1); vime then starts no engines (default: %(default)s).")
    g.add_argument("--engine-startup-timeout", type=float,
                   help="Seconds an engine may take to answer /health after start (default: %(default)g).")
    g.add_argument("--cpu-kv-cache-space", type=int,
                   help="GiB of KV cache per engine on CPU, VLLM_CPU_KVCACHE_SPACE (default: %(default)s).")
    apply_defaults(parser, EnginesConfig)  # defaults: vime/config


def add_fault_tolerance_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault tolerance")
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="Health-check the engines; a dead or hung engine is taken out of the router, restarted, "
                        "given the current weights and registered again (default: off).")
    g.add_argument("--rollout-health-check-interval", type=float,
                   help="Seconds between health checks of each engine (default: %(default)g).")
    g.add_argument("--rollout-health-check-timeout", type=float,
                   help="Seconds an engine may take to answer /health before it counts as hung (default: %(default)g).")
    g.add_argument("--rollout-health-check-first-wait", type=float,
                   help="Seconds after engine start before the first health check (default: %(default)g).")
    g.add_argument("--max-failed-samples-ratio", type=float,
                   help="A rollout with a larger fraction of failed samples (engines or router down) is not trained "
                        "on: no optimizer or scheduler step, its metrics row has train/skipped_rollout 1 "
                        "(default: %(default)s).")
    g.add_argument("--max-consecutive-failed-rollouts", type=int,
                   help="Stop the run with an error after this many rollouts in a row were skipped for "
                        "--max-failed-samples-ratio (default: %(default)s).")
    apply_defaults(parser, FaultToleranceConfig)  # defaults: vime/config


def add_buffer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data buffer")
    g.add_argument("--rollout-data-transport", choices=("object-store", "straw"),
                   help="How rollouts travel from the rollout manager to the trainers: Ray's object store, or "
                        "straw queues on a shared directory that survive a crash (default: %(default)s).")
    g.add_argument("--rollout-data-dir",
                   help="Shared directory of the straw transport (default: <output-dir>/rollout_data).")
    apply_defaults(parser, DataBufferConfig)  # defaults: vime/config


def add_reward_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rewards")
    g.add_argument("--rm-type",
                   help="Built-in reward: math, boxed, deepscaler, dapo, exact_match, f1, gpqa, remote_rm, "
                        "random (default: None; then --custom-rm-path is required).")
    g.add_argument("--custom-rm-path",
                   help="async reward(args, sample) -> float | dict; with --group-rm, "
                        "reward(args, samples) -> list (default: %(default)s).")
    g.add_argument("--group-rm", action="store_true",
                   help="Score each group of samples in one call (default: off).")
    g.add_argument("--rm-url", help="URL of a remote reward model, for --rm-type remote_rm.")
    g.add_argument("--rm-max-retries", type=int, help="Retries of a remote reward call (default: %(default)s).")
    g.add_argument("--rm-timeout", type=float,
                   help="Seconds before one reward call fails; the sample is then marked failed "
                        "(default: %(default)g).")
    g.add_argument("--reward-key",
                   help="Field of a dict-valued reward used as the scalar reward (default: %(default)s).")
    g.add_argument("--rm-attempt-timeout", type=float,
                   help="Seconds one remote reward attempt may take at most; all attempts share --rm-timeout "
                        "(default: None, the time left split evenly over the attempts left).")
    g.add_argument("--rm-num-workers", type=int,
                   help="Reward worker processes, where rewards that can hang run and are killed at --rm-timeout "
                        "(--rm-type math, --custom-rm-in-workers) (default: None, min(4, CPUs of this process)).")
    g.add_argument("--rm-worker-memory-mb", type=int,
                   help="Address-space cap of each reward worker process in MiB (RLIMIT_AS); a call past it fails "
                        "that sample; 0 for none (default: %(default)s).")
    g.add_argument("--custom-rm-in-workers", action="store_true",
                   help="Run --custom-rm-path (sync or async) in the reward worker processes, killed at --rm-timeout, "
                        "instead of a thread that cannot be stopped; it must be importable in a fresh process and "
                        "take and return JSON-able values (default: off).")
    apply_defaults(parser, RewardConfig)  # defaults: vime/config


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation")
    g.add_argument("--eval-prompt-data", nargs="+",
                   help="Pairs NAME PATH [NAME PATH ...] of eval prompt files (default: %(default)s).")
    g.add_argument("--eval-interval", type=int,
                   help="Evaluate every this many rollouts, and before the first (default: None = never).")
    g.add_argument("--eval-function-path", help="Rollout function for eval (default: --rollout-function-path).")
    g.add_argument("--custom-eval-rollout-log-function-path",
                   help="log(rollout_id, args, data, extra_metrics) -> bool, called with each eval's "
                        "{name: {'rewards', 'truncated', 'samples'}}; True skips vime's own eval metrics "
                        "(default: %(default)s).")
    g.add_argument("--n-samples-per-eval-prompt", type=int, help="Responses per eval prompt (default: %(default)s).")
    g.add_argument("--eval-pass-at-k", type=_ks,
                   help="Comma-separated k's, e.g. 1,4: each eval set also reports pass@k (unbiased estimator), "
                        "mean@k and maj@k over its --n-samples-per-eval-prompt samples per prompt, as "
                        "eval/<name>/pass@k etc.; a sample is correct when its reward is > 0 (default: %(default)s).")
    g.add_argument("--eval-temperature", type=float,
                   help="Sampling temperature for eval (default: --rollout-temperature).")
    g.add_argument("--eval-top-p", type=float, help="Top-p for eval (default: --rollout-top-p).")
    g.add_argument("--eval-top-k", type=int, help="Top-k for eval (default: --rollout-top-k).")
    g.add_argument("--eval-max-response-len", type=int,
                   help="Max new tokens for eval (default: --rollout-max-response-len).")
    apply_defaults(parser, EvalConfig)  # defaults: vime/config


def _ks(text: str) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers such as 1,4") from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every k must be >= 1")
    return ks


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
