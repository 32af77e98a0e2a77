"""Sections of the rollout side: prompt data, generation, engines, fault tolerance, the data buffer, rewards and
evaluation."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Literal

from vime.config.section import Section, flag


@dataclasses.dataclass(frozen=True)
class PromptDataConfig(Section):
    """The prompt dataset and how rows become prompts (`--prompt-data`, `--input-key`, ...)."""

    prompt_data: str | None = flag(None, "JSONL or Parquet file of prompts (default: %(default)s).")
    input_key: str = flag("prompt", "Row field holding the prompt: a string, or a list of chat messages (default: "
                          "%(default)s).")
    label_key: str | None = flag(None, "Row field holding the reference answer (default: %(default)s).")
    metadata_key: str = flag("metadata", "Row field (a dict) copied into Sample.metadata when present (default: "
                             "%(default)s).")
    tool_key: str | None = flag(None, "Row field with tool schemas passed to the chat template (default: "
                                "%(default)s).")
    apply_chat_template: bool = flag(False, "Format prompts with the tokenizer's chat template (default: off).")
    apply_chat_template_kwargs: dict[str, Any] | str | None = flag(  # JSON text given, a dict once validated
        None, "JSON dict of extra keyword arguments for apply_chat_template (default: %(default)s).", parse=str)
    rollout_max_prompt_len: int | None = flag(None, "Drop prompts longer than this many tokens when loading "
                                              "(default: no limit).")
    max_bad_prompt_rows_ratio: float = flag(
        0.1, "Malformed prompt rows (bad JSON, missing --input-key, bad chat messages) are skipped with a warning "
        "and counted in data/skipped_rows; loading fails when more than this fraction of the rows, or all of them, "
        "are malformed (default: %(default)s).")
    rollout_shuffle: bool = flag(False, "Shuffle prompts each epoch, seeded by --rollout-seed and the epoch "
                                 "(default: off).")
    num_epoch: int | None = flag(None, "Epochs over the prompt data; sets --num-rollout when that is unset "
                                 "(default: %(default)s).")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    """Generation: batch, sampling, hooks and request limits (`--rollout-*`, `--n-samples-per-prompt`, ...)."""

    rollout_function_path: str = flag("vime.rollout.vllm_rollout.generate_rollout",
                                      "generate_rollout(args, rollout_id, data_source, evaluation=False) (default: "
                                      "%(default)s).")
    rollout_timeout: float = flag(
        3600.0, "Seconds a whole rollout (or eval) may take before the run stops with an error naming the rollout "
        "function; a function that never returns must not hang the run (default: %(default)g).")
    custom_generate_function_path: str | None = flag(
        None, "async generate(args, sample, sampling_params) -> Sample, replacing the single-turn default: "
        "multi-turn, tools, agents (default: %(default)s).")
    rollout_batch_size: int = flag(8, "Prompts (groups) per rollout (default: %(default)s).")
    n_samples_per_prompt: int = flag(1, "Responses sampled per prompt; one group (default: %(default)s).")
    over_sampling_batch_size: int | None = flag(None, "Groups submitted at a time when dynamic sampling drops some; "
                                                "must be >= --rollout-batch-size (default: --rollout-batch-size).")
    dynamic_sampling_filter_path: str | None = flag(
        None, "filter(args, samples) -> DynamicFilterOutput; groups it rejects are dropped and more are generated, "
        "e.g. vime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std (default: %(default)s).")
    max_dynamic_sampling_rounds: int = flag(8, "Give up on dynamic sampling after this many passes over "
                                            "--over-sampling-batch-size groups without filling the batch (default: "
                                            "%(default)s).")
    rollout_temperature: float = flag(1.0, "Sampling temperature (default: %(default)s).")
    rollout_top_p: float = flag(1.0, "Nucleus sampling p (default: %(default)s).")
    rollout_top_k: int = flag(-1, "Top-k sampling; -1 disables (default: %(default)s).")
    rollout_max_response_len: int = flag(256, "Maximum new tokens per response (default: %(default)s).")
    rollout_stop: list[str] | None = flag(None, "Stop strings (default: %(default)s).")
    rollout_stop_token_ids: list[int] | None = flag(None, "Stop token ids in addition to EOS (default: "
                                                    "%(default)s).")
    rollout_seed: int | None = flag(None, "Seed for data shuffling and per-request sampling seeds (default: "
                                    "--seed).")
    rollout_concurrency: int = flag(256, "Maximum generate requests in flight across all engines (default: "
                                    "%(default)s).")
    rollout_request_timeout: float = flag(600.0, "Seconds before one generate request is abandoned and retried "
                                          "(default: %(default)g).")
    rollout_request_retries: int = flag(3, "Retries of a failed generate request before the sample is marked "
                                        "failed (default: %(default)s).")
    partial_rollout: bool = flag(
        False, "Keep groups cut off when the batch filled (aborted mid-generation) and continue them first in the "
        "next rollout instead of discarding them (default: off).")
    mask_offpolicy_in_partial_rollout: bool = flag(
        False, "With --partial-rollout: do not train on the tokens generated before the abort (older weights); "
        "only the continuation is trained (default: off).")
    buffer_filter_path: str | None = flag(
        None, "filter(args, buffer, num_groups) -> groups: which kept groups are served next (default: "
        "vime.rollout.filter_hub.buffer_filters.pop_first, oldest first).")
    custom_reward_post_process_path: str | None = flag(
        None, "post_process(args, samples) -> None, run on each finished group after rewards, e.g. to shape "
        "rewards (default: %(default)s).")
    # slime's rollout-side hooks (function paths)
    data_source_path: str | None = flag(
        None, "slime's data source class, made as cls(args): get_samples(num_groups) -> list[list[Sample]], "
        "add_samples(groups), save(rollout_id) and load(rollout_id) at checkpoints, len() (default: None = "
        "vime's, over --prompt-data).")
    custom_convert_samples_to_train_data_path: str | None = flag(
        None, "convert(args, samples) -> dict of per-sample lists (slime's train data: tokens, response_lengths, "
        "rewards, loss_masks, rollout_log_probs, truncated, ...) in place of the default conversion; what it "
        "returns is what the trainer trains on (default: %(default)s).")
    custom_rollout_log_function_path: str | None = flag(
        None, "log(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool, called with each "
        "rollout's samples; True skips vime's own rollout metrics for it (default: %(default)s).")

    def check(self) -> None:
        if not self.rollout_timeout > 0:
            raise ValueError(f"--rollout-timeout must be a positive number of seconds, got {self.rollout_timeout}")
        at_least_one(self.named("rollout_batch_size", "n_samples_per_prompt", "rollout_max_response_len",
                                "rollout_concurrency"))
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.rollout_batch_size:
            raise ValueError(f"--over-sampling-batch-size ({self.over_sampling_batch_size}) must be >= "
                             f"--rollout-batch-size ({self.rollout_batch_size})")
        if self.rollout_temperature <= 0:
            raise ValueError("--rollout-temperature must be > 0: RL needs sampled responses and their log-probs")
        if not 0 < self.rollout_top_p <= 1:
            raise ValueError(f"--rollout-top-p must be in (0, 1], got {self.rollout_top_p}")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ValueError("--mask-offpolicy-in-partial-rollout needs --partial-rollout")


@dataclasses.dataclass(frozen=True)
class EnginesConfig(Section):
    """The policy's vLLM engines: count, devices, external ones, start-up (`--rollout-num-gpus*`, ...)."""

    rollout_num_gpus: int = flag(1, "Devices for rollout engines; on CPU, the number of engine slots (default: "
                                 "%(default)s).")
    rollout_num_gpus_per_engine: int = flag(1, "Devices per engine (tensor parallel on GPU); 1 on CPU (default: "
                                            "%(default)s).")
    rollout_external_engine_addrs: list[str] | None = flag(
        None, "host:port of vLLM servers started elsewhere (with --enable-scale-out, processed log-probs, "
        "VLLM_SERVER_DEV_MODE=1); vime then starts no engines (default: %(default)s).")
    engine_startup_timeout: float = flag(600.0, "Seconds an engine may take to answer /health after start (default: "
                                         "%(default)g).")
    cpu_kv_cache_space: int = flag(1, "GiB of KV cache per engine on CPU, VLLM_CPU_KVCACHE_SPACE (default: "
                                   "%(default)s).")

    def num_engines(self) -> int:
        """The policy's engine count: one per external address given, else one per --rollout-num-gpus-per-engine."""
        if self.rollout_external_engine_addrs:
            return len(self.rollout_external_engine_addrs)
        return self.rollout_num_gpus // self.rollout_num_gpus_per_engine

    def check(self) -> None:
        if not self.engine_startup_timeout > 0:
            raise ValueError("--engine-startup-timeout must be a positive number of seconds, got "
                             f"{self.engine_startup_timeout}")
        at_least_one(self.named("rollout_num_gpus", "rollout_num_gpus_per_engine"))
        if self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ValueError(f"--rollout-num-gpus ({self.rollout_num_gpus}) must be a multiple of "
                             f"--rollout-num-gpus-per-engine ({self.rollout_num_gpus_per_engine})")
        for addr in self.rollout_external_engine_addrs or []:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--rollout-external-engine-addrs: {addr!r} is not host:port")


@dataclasses.dataclass(frozen=True)
class FaultToleranceConfig(Section):
    """Engine health checks and how many failures a run tolerates (`--use-fault-tolerance`, ...)."""

    use_fault_tolerance: bool = flag(
        False, "Health-check the engines; a dead or hung engine is taken out of the router, restarted, given the "
        "current weights and registered again (default: off).")
    rollout_health_check_interval: float = flag(5.0, "Seconds between health checks of each engine (default: "
                                                "%(default)g).")
    rollout_health_check_timeout: float = flag(10.0, "Seconds an engine may take to answer /health before it counts "
                                               "as hung (default: %(default)g).")
    rollout_health_check_first_wait: float = flag(0.0, "Seconds after engine start before the first health check "
                                                  "(default: %(default)g).")
    max_failed_samples_ratio: float = flag(
        0.5, "A rollout with a larger fraction of failed samples (engines or router down) is not trained on: no "
        "optimizer or scheduler step, its metrics row has train/skipped_rollout 1 (default: %(default)s).")
    max_consecutive_failed_rollouts: int = flag(3, "Stop the run with an error after this many rollouts in a row "
                                                "were skipped for --max-failed-samples-ratio (default: %(default)s).")

    def check(self) -> None:
        for option, seconds in self.named("rollout_health_check_interval", "rollout_health_check_timeout"):
            if seconds <= 0:
                raise ValueError(f"{option} must be > 0, got {seconds}")
        if not 0.0 <= self.max_failed_samples_ratio <= 1.0:
            raise ValueError(f"--max-failed-samples-ratio must be in [0, 1], got {self.max_failed_samples_ratio}")
        if self.max_consecutive_failed_rollouts < 1:
            raise ValueError("--max-consecutive-failed-rollouts must be >= 1, got "
                             f"{self.max_consecutive_failed_rollouts}")


@dataclasses.dataclass(frozen=True)
class DataBufferConfig(Section):
    """Where rollouts are kept between generation and training (`--rollout-data-*`)."""

    rollout_data_transport: Literal["object-store", "straw"] = flag(
        "object-store", "How rollouts travel from the rollout manager to the trainers: Ray's object store, or straw "
        "queues on a shared directory that survive a crash (default: %(default)s).")
    rollout_data_dir: str | None = flag(None, "Shared directory of the straw transport (default: "
                                        "<output-dir>/rollout_data).")


@dataclasses.dataclass(frozen=True)
class RewardConfig(Section):
    """Reward functions, workers and remote reward models (`--rm-*`, `--custom-rm-path`, ...)."""

    rm_type: str | None = flag(None, "Built-in reward: math, boxed, deepscaler, dapo, exact_match, f1, gpqa, "
                               "remote_rm, random (default: None; then --custom-rm-path is required).")
    custom_rm_path: str | None = flag(None, "async reward(args, sample) -> float | dict; with --group-rm, "
                                      "reward(args, samples) -> list (default: %(default)s).")
    group_rm: bool = flag(False, "Score each group of samples in one call (default: off).")
    rm_url: str | None = flag(None, "URL of a remote reward model, for --rm-type remote_rm.")
    rm_max_retries: int = flag(3, "Retries of a remote reward call (default: %(default)s).")
    rm_timeout: float = flag(60.0, "Seconds before one reward call fails; the sample is then marked failed "
                             "(default: %(default)g).")
    reward_key: str | None = flag(None, "Field of a dict-valued reward used as the scalar reward (default: "
                                  "%(default)s).")
    rm_attempt_timeout: float | None = flag(
        None, "Seconds one remote reward attempt may take at most; all attempts share --rm-timeout (default: None, "
        "the time left split evenly over the attempts left).")
    rm_num_workers: int | None = flag(
        None, "Reward worker processes, where rewards that can hang run and are killed at --rm-timeout (--rm-type "
        "math, --custom-rm-in-workers) (default: None, min(4, CPUs of this process)).")
    rm_worker_memory_mb: int = flag(
        4096, "Address-space cap of each reward worker process in MiB (RLIMIT_AS); a call past it fails that "
        "sample; 0 for none (default: %(default)s).")
    custom_rm_in_workers: bool = flag(
        False, "Run --custom-rm-path (sync or async) in the reward worker processes, killed at --rm-timeout, "
        "instead of a thread that cannot be stopped; it must be importable in a fresh process and take and return "
        "JSON-able values (default: off).")


def _ks(text: str) -> list[int]:
    """--eval-pass-at-k's value: comma-separated k's (e.g. 1,4), sorted and deduplicated, each >= 1."""
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers such as 1,4") from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every k must be >= 1")
    return ks


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """Evaluation datasets, cadence and sampling (`--eval-*`)."""

    eval_prompt_data: list[str] | None = flag(None, "Pairs NAME PATH [NAME PATH ...] of eval prompt files "
                                              "(default: %(default)s).")
    eval_interval: int | None = flag(None, "Evaluate every this many rollouts, and before the first (default: None "
                                     "= never).")
    eval_function_path: str | None = flag(None, "Rollout function for eval (default: --rollout-function-path).")
    custom_eval_rollout_log_function_path: str | None = flag(
        None, "log(rollout_id, args, data, extra_metrics) -> bool, called with each eval's {name: {'rewards', "
        "'truncated', 'samples'}}; True skips vime's own eval metrics (default: %(default)s).")
    n_samples_per_eval_prompt: int = flag(1, "Responses per eval prompt (default: %(default)s).")
    eval_pass_at_k: list[int] | None = flag(
        None, "Comma-separated k's, e.g. 1,4: each eval set also reports pass@k (unbiased estimator), mean@k and "
        "maj@k over its --n-samples-per-eval-prompt samples per prompt, as eval/<name>/pass@k etc.; a sample is "
        "correct when its reward is > 0 (default: %(default)s).", parse=_ks)
    eval_temperature: float | None = flag(None, "Sampling temperature for eval (default: --rollout-temperature).")
    eval_top_p: float | None = flag(None, "Top-p for eval (default: --rollout-top-p).")
    eval_top_k: int | None = flag(None, "Top-k for eval (default: --rollout-top-k).")
    eval_max_response_len: int | None = flag(None, "Max new tokens for eval (default: --rollout-max-response-len).")

    def check(self) -> None:
        at_least_one(self.named("n_samples_per_eval_prompt"))
        if self.eval_prompt_data is not None and len(self.eval_prompt_data) % 2:
            raise ValueError("--eval-prompt-data takes pairs NAME PATH [NAME PATH ...]")
        if self.eval_pass_at_k and self.eval_pass_at_k[-1] > self.n_samples_per_eval_prompt:
            raise ValueError(f"--eval-pass-at-k {','.join(map(str, self.eval_pass_at_k))}: k = "
                             f"{self.eval_pass_at_k[-1]} needs --n-samples-per-eval-prompt >= "
                             f"{self.eval_pass_at_k[-1]} (got {self.n_samples_per_eval_prompt})")


def at_least_one(counts: list[tuple[str, int | None]]) -> None:
    """Refuse a count flag given below 1 (None: not given)."""
    for option, value in counts:
        if value is not None and value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
