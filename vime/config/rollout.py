"""Sections of the rollout side: prompt data, generation, engines, fault tolerance, the data buffer, rewards and
evaluation."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from vime.config.section import Section


@dataclasses.dataclass(frozen=True)
class PromptDataConfig(Section):
    """The prompt dataset and how rows become prompts (`--prompt-data`, `--input-key`, ...)."""

    prompt_data: str | None = None
    input_key: str = "prompt"
    label_key: str | None = None
    metadata_key: str = "metadata"
    tool_key: str | None = None
    apply_chat_template: bool = False
    apply_chat_template_kwargs: dict[str, Any] | str | None = None  # JSON text given, a dict once validated
    rollout_max_prompt_len: int | None = None
    max_bad_prompt_rows_ratio: float = 0.1
    rollout_shuffle: bool = False
    num_epoch: int | None = None


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    """Generation: batch, sampling, hooks and request limits (`--rollout-*`, `--n-samples-per-prompt`, ...)."""

    rollout_function_path: str = "vime.rollout.vllm_rollout.generate_rollout"
    rollout_timeout: float = 3600.0
    custom_generate_function_path: str | None = None
    rollout_batch_size: int = 8
    n_samples_per_prompt: int = 1
    over_sampling_batch_size: int | None = None
    dynamic_sampling_filter_path: str | None = None
    max_dynamic_sampling_rounds: int = 8
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_max_response_len: int = 256
    rollout_stop: list[str] | None = None
    rollout_stop_token_ids: list[int] | None = None
    rollout_seed: int | None = None
    rollout_concurrency: int = 256
    rollout_request_timeout: float = 600.0
    rollout_request_retries: int = 3
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    buffer_filter_path: str | None = None
    custom_reward_post_process_path: str | None = None
    # slime's rollout-side hooks (function paths)
    data_source_path: str | None = None
    custom_convert_samples_to_train_data_path: str | None = None
    custom_rollout_log_function_path: str | None = None

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

    rollout_num_gpus: int = 1
    rollout_num_gpus_per_engine: int = 1
    rollout_external_engine_addrs: list[str] | None = None
    engine_startup_timeout: float = 600.0
    cpu_kv_cache_space: int = 1

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

    use_fault_tolerance: bool = False
    rollout_health_check_interval: float = 5.0
    rollout_health_check_timeout: float = 10.0
    rollout_health_check_first_wait: float = 0.0
    max_failed_samples_ratio: float = 0.5
    max_consecutive_failed_rollouts: int = 3

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

    rollout_data_transport: Literal["object-store", "straw"] = "object-store"
    rollout_data_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class RewardConfig(Section):
    """Reward functions, workers and remote reward models (`--rm-*`, `--custom-rm-path`, ...)."""

    rm_type: str | None = None
    custom_rm_path: str | None = None
    group_rm: bool = False
    rm_url: str | None = None
    rm_max_retries: int = 3
    rm_timeout: float = 60.0
    reward_key: str | None = None
    rm_attempt_timeout: float | None = None
    rm_num_workers: int | None = None
    rm_worker_memory_mb: int = 4096
    custom_rm_in_workers: bool = False


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """Evaluation datasets, cadence and sampling (`--eval-*`)."""

    eval_prompt_data: list[str] | None = None
    eval_interval: int | None = None
    eval_function_path: str | None = None
    custom_eval_rollout_log_function_path: str | None = None
    n_samples_per_eval_prompt: int = 1
    eval_pass_at_k: list[int] | None = None
    eval_temperature: float | None = None
    eval_top_p: float | None = None
    eval_top_k: int | None = None
    eval_max_response_len: int | None = None

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
