"""Sections of the run as a whole: the job (checkpoint, seed, output, Ray, control), wandb, placement and debugging."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

from vime.config.section import Section, flag


@dataclasses.dataclass(frozen=True)
class JobConfig(Section):
    """The run as a whole: checkpoint, seed, output, Ray and control (`--hf-checkpoint`, `--seed`, ...)."""

    config: str | None = flag(None, "YAML file of flag: value pairs; flags given on the command line win (default: "
                              "%(default)s).")
    hf_checkpoint: str | None = flag(None, "HF checkpoint directory of the policy: config, weights and tokenizer "
                                     "(required).")
    seed: int = flag(1234, "Global random seed (default: %(default)s).")
    num_rollout: int | None = flag(None, "Number of rollouts (generate -> train steps) to run (default: from "
                                   "--num-epoch).")
    output_dir: str = flag("outputs/run", "Directory for metrics.jsonl, TensorBoard events and plots (default: "
                           "%(default)s).")
    ray_address: str | None = flag(None, "Address of an existing Ray cluster; a local one is started when unset "
                                   "(default: %(default)s).")
    overwrite_output: bool = flag(False, "Start over an earlier run's state in --save, --output-dir and "
                                  "--rollout-data-dir (its trained-sample ids and stored rollouts are discarded); "
                                  "without it such a run refuses to start unless --load resumes it (default: off).")
    train_timeout: float = flag(7200.0, "Seconds the trainers may take for one call (building the models, a "
                                "rollout's steps, a checkpoint save, a weight update) before the run stops with an "
                                "error naming the call: a stuck rank or collective must not hang the run (default: "
                                "%(default)g).")
    control_token_file: str | None = flag(None, "File (mode 600) holding the run's control token, which every engine "
                                          "route but /health requires; a fresh random token is made when unset "
                                          "(default: %(default)s).")
    serving_interface: str | None = flag(None, "On a cluster (--ray-address): the network interface the engines "
                                         "listen on, e.g. eth1; the node address Ray uses when unset. Without a "
                                         "cluster everything listens on loopback (default: %(default)s).")

    def check(self) -> None:
        if not self.train_timeout > 0:
            raise ValueError(f"--train-timeout must be a positive number of seconds, got {self.train_timeout}")


@dataclasses.dataclass(frozen=True)
class WandbConfig(Section):
    """Weights & Biases logging (`--use-wandb`, `--wandb-*`)."""

    use_wandb: bool = flag(False, "Log each rollout's metrics and the reward curve to wandb (pip install "
                           "wandb==0.31.0) (default: off).")
    wandb_project: str = flag("vime", "wandb project of the run (default: %(default)s).")
    wandb_group: str | None = flag(None, "wandb group the run belongs to (default: %(default)s).")
    wandb_run_name: str | None = flag(None, "wandb run name; wandb makes one up when unset (default: %(default)s).")
    wandb_mode: Literal["online", "offline", "disabled"] = flag(
        "online", "online uploads as the run goes; offline writes the run under --wandb-dir only, for `wandb sync` "
        "later, with no account or network needed (default: %(default)s).")
    wandb_dir: str | None = flag(None, "Directory for wandb's local files (default: <output-dir>/wandb).")
    # slime's; a secret: never written (resolved_config.SECRET_FLAG)
    wandb_key: str | None = flag(None, "slime's: the wandb API key, given to wandb in this process only (never "
                                 "written to disk or to the run's config). A command line is readable by every user "
                                 "of the node: prefer WANDB_API_KEY in the environment, or `wandb login` (default: "
                                 "None).")

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

    actor_num_nodes: int = flag(1, "Nodes for training actors (default: %(default)s).")
    actor_num_gpus_per_node: int = flag(1, "Devices per node for training; on CPU, training processes per node "
                                        "(default: %(default)s).")
    colocate: bool = flag(False, "Training and rollout share devices and take turns (default: off).")
    offload_train: bool = flag(False, "With --colocate: move the trainer's weights, gradients and optimizer state to "
                               "host memory while the engines generate (default: off).")
    offload_rollout: bool = flag(False, "With --colocate: put the engines to sleep (vLLM /sleep, frees GPU memory) "
                                 "while training (default: off).")
    gpu_memory_gib: float | None = flag(None, "Memory of one GPU, GiB, for the memory plan a GPU run checks before "
                                        "it starts (`python -m vime.plan`); default: that of the cluster's GPU model "
                                        "as Ray names it (default: %(default)s).")

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
