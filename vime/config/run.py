"""Sections of the run as a whole: the job (checkpoint, seed, output, Ray, control), wandb, placement and debugging."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

from vime.config.section import Section, flag


@dataclasses.dataclass(frozen=True)
class JobConfig(Section):
    """The run as a whole: checkpoint, seed, output, Ray and control (`--hf-checkpoint`, `--seed`, ...)."""

    config: str | None = None
    hf_checkpoint: str | None = None
    seed: int = 1234
    num_rollout: int | None = None
    output_dir: str = "outputs/run"
    ray_address: str | None = None
    overwrite_output: bool = False
    train_timeout: float = 7200.0
    control_token_file: str | None = None
    serving_interface: str | None = None

    def check(self) -> None:
        if not self.train_timeout > 0:
            raise ValueError(f"--train-timeout must be a positive number of seconds, got {self.train_timeout}")


@dataclasses.dataclass(frozen=True)
class WandbConfig(Section):
    """Weights & Biases logging (`--use-wandb`, `--wandb-*`)."""

    use_wandb: bool = False
    wandb_project: str = "vime"
    wandb_group: str | None = None
    wandb_run_name: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    wandb_dir: str | None = None
    wandb_key: str | None = None  # slime's; a secret: never written (resolved_config.SECRET_FLAG)

    def check(self) -> None:
        if self.use_wandb:
            return
        unset = WandbConfig()
        given = [option for option, value in self.named(*(f.name for f in dataclasses.fields(self)))
                 if value != getattr(unset, option[2:].replace("-", "_"))]
        if given:
            raise ValueError(f"{' '.join(given)} only take effect with --use-wandb: add it, or drop them")


@dataclasses.dataclass(frozen=True)
class PlacementConfig(Section):
    """Where trainers and engines run (`--actor-*`, `--colocate`, `--offload-*`)."""

    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    colocate: bool = False
    offload_train: bool = False
    offload_rollout: bool = False
    gpu_memory_gib: float | None = None  # the memory plan's device size; default: the cluster's GPU model's

    def check(self) -> None:
        if self.gpu_memory_gib is not None and self.gpu_memory_gib <= 0:
            raise ValueError(f"--gpu-memory-gib {self.gpu_memory_gib}: give one device's memory in GiB, e.g. 80")
        for option, on in self.named("offload_rollout", "offload_train"):
            if on and not self.colocate:
                raise ValueError(f"{option} only makes sense with --colocate (engines and trainer share devices)")


@dataclasses.dataclass(frozen=True)
class DebugConfig(Section):
    """Half runs and what a run saves for inspection (`--debug-*`, `--save-rollouts*`)."""

    debug_rollout_only: bool = flag(False, "Generate and score rollouts without training (default: off).")
    debug_train_only: bool = flag(False, "Train from --load-debug-rollout-data without starting engines (default: "
                                  "off).")
    save_debug_rollout_data: str | None = flag(None, "Path template with {rollout_id}; each rollout's samples are "
                                               "written there as JSON lines, one Sample.to_dict() per line "
                                               "(default: %(default)s).")
    load_debug_rollout_data: str | None = flag(None, "Path template with {rollout_id}: replay saved rollouts "
                                               "instead of generating (default: %(default)s).")
    save_rollouts: bool = flag(True, "Keep a compact copy of each rollout (and eval) in <output-dir>/rollouts/, "
                               "which `python -m vime.inspect <output-dir>` renders; --no-save-rollouts turns it off "
                               "(default: on).", action=argparse.BooleanOptionalAction)
    save_rollouts_max_mb: float = flag(512.0, "Size cap of <output-dir>/rollouts/ in megabytes: the oldest rollouts "
                                       "there are deleted to stay under it (default: %(default)g).")

    def check(self) -> None:
        if self.debug_rollout_only and self.debug_train_only:
            raise ValueError("--debug-rollout-only and --debug-train-only exclude each other; pick one")
        if self.debug_rollout_only and self.load_debug_rollout_data is not None:
            raise ValueError("--debug-rollout-only generates rollouts; it cannot also --load-debug-rollout-data")
        if self.save_rollouts_max_mb <= 0:
            raise ValueError(f"--save-rollouts-max-mb must be > 0, got {self.save_rollouts_max_mb} (turn saving off "
                             "with --no-save-rollouts)")
        for option, template in self.named("save_debug_rollout_data", "load_debug_rollout_data"):
            if template is not None and "{rollout_id}" not in template:
                raise ValueError(f"{option} {template!r} must contain '{{rollout_id}}'")
