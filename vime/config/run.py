"""Sections of the run as a whole: the job (checkpoint, seed, output, Ray, control), wandb, placement and debugging."""

from __future__ import annotations

import dataclasses
from typing import Literal

from vime.config.section import Section


@dataclasses.dataclass(frozen=True)
class JobConfig(Section):
    """The run as a whole: checkpoint, seed, output, Ray and control (`--hf-checkpoint`, `--seed`, ...)."""

    config: str | None = None
    hf_checkpoint: str | None = None
    seed: int = 1234
    num_rollout: int | None = None
    output_dir: str = 'outputs/run'
    ray_address: str | None = None
    overwrite_output: bool = False
    train_timeout: float = 7200.0
    control_token_file: str | None = None
    serving_interface: str | None = None


@dataclasses.dataclass(frozen=True)
class WandbConfig(Section):
    """Weights & Biases logging (`--use-wandb`, `--wandb-*`)."""

    use_wandb: bool = False
    wandb_project: str = 'vime'
    wandb_group: str | None = None
    wandb_run_name: str | None = None
    wandb_mode: Literal['online', 'offline', 'disabled'] = 'online'
    wandb_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class PlacementConfig(Section):
    """Where trainers and engines run (`--actor-*`, `--colocate`, `--offload-*`)."""

    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    colocate: bool = False
    offload_train: bool = False
    offload_rollout: bool = False


@dataclasses.dataclass(frozen=True)
class DebugConfig(Section):
    """Half runs and what a run saves for inspection (`--debug-*`, `--save-rollouts*`)."""

    debug_rollout_only: bool = False
    debug_train_only: bool = False
    save_debug_rollout_data: str | None = None
    load_debug_rollout_data: str | None = None
    save_rollouts: bool = True
    save_rollouts_max_mb: float = 512.0
