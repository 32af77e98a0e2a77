"""A training rank's Ray actor: one per Megatron rank, hosting its `MegatronTrainer`. The driver builds and drives
them through `vime.driver.train_group.RayTrainGroup`; each of the group's verbs runs the method of the same name here,
which calls the trainer's."""

from __future__ import annotations

import logging
import os
import time

from vime.config.rollout import DataBufferConfig
from vime.config.train import MegatronConfig, TrainLoopConfig
from vime.transport.rollouts import make_transport
from vime.utils.cpus import CpuShare, allowed_cpus, use_cpus
from vime.utils.device import serving_host
from vime.utils.logging_utils import configure_logging
from vime.utils.rendezvous import reserve_rendezvous

logger = logging.getLogger(__name__)


class TrainActor:
    """Hosts one `MegatronTrainer`; its methods are what the driver calls over Ray."""

    def __init__(self, args, rank: int, world_size: int, role: str = "actor", cpu_share: CpuShare | None = None,
                 local_rank: int = 0):
        train_loop = TrainLoopConfig.of(args)
        configure_logging()  # an actor process: its log lines reach the driver's console through Ray
        self.args, self.rank, self.world_size, self.role = args, rank, world_size, role
        self.local_rank = local_rank  # its index among its group's ranks on this node (`Placement.local_rank`)
        self.trainer = None
        self.weight_transports = {}  # kind -> this rank's half of it (a WeightSender, kept for the run)
        self.rollouts = make_transport(DataBufferConfig.of(args))  # where this rank reads the rollouts it trains on
        self.last_rollout: tuple[int, list] | None = None  # (id, groups): PPO's critic reads one rollout twice
        # Ray gives an actor of one logical CPU one OpenMP thread; the placement's share is what it computes on
        share = cpu_share or CpuShare()
        if train_loop.train_num_threads:  # the user's count, on whatever CPUs the OS picks
            self.threads = use_cpus(allowed_cpus(), threads=train_loop.train_num_threads, pin=False)
        else:
            self.threads = use_cpus(share.cpus(allowed_cpus()))
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        logger.info("%s rank %d: %s%s", role, rank, self.threads, f", GPU {gpus}" if gpus else "")

    def compute_threads(self) -> tuple[int, list[int]]:
        """(torch intra-op threads, CPUs this process may run on)."""
        import torch

        return torch.get_num_threads(), allowed_cpus()

    def devices(self) -> dict:
        """What this rank computes on: the GPUs Ray shows it (CUDA_VISIBLE_DEVICES) and its LOCAL_RANK."""
        return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "local_rank": self.local_rank}

    def address(self) -> tuple[str, int]:
        """Where a group this rank serves the store of meets (the training group, the weight-broadcast group): a
        port on this node's serving address, bound now and kept until the store takes it (`reserve_rendezvous`)."""
        return reserve_rendezvous(serving_host(self.args))

    def init(self, master_addr: str, master_port: int, total_steps: int) -> None:
        from vime.trainer.trainer import MegatronTrainer

        self.trainer = MegatronTrainer(self.args, self.rank, self.world_size, master_addr, master_port, total_steps,
                                       role=self.role, local_rank=self.local_rank)

    def _read(self, handle) -> list[list[dict]]:
        """The rollout behind a data-transport handle, as groups of sample dicts."""
        if self.last_rollout is None or self.last_rollout[0] != handle.rollout_id:
            vocab_size = MegatronConfig.of(self.trainer.args).vocab_size
            self.last_rollout = (handle.rollout_id, self.rollouts.get(handle, vocab_size)[0])
        return self.last_rollout[1]

    def train(self, rollout_id: int, handle) -> dict:
        groups = self._read(handle)
        start = time.perf_counter()
        metrics = self.trainer.train(rollout_id, groups)
        if metrics:  # the rank that reports: the FLOPs it ran, per second, and their share of its device's peak
            from vime.trainer.flops import flop_metrics

            metrics.update(flop_metrics(self.trainer, groups, time.perf_counter() - start))
        return metrics

    # PPO: the critic's values for the actor, the actor's returns for the critic. Values arrive as one dict per
    # critic rank ({sample index: per-token values}); Ray resolves the refs the driver passes on.
    def train_with_values(self, rollout_id: int, handle, *value_parts: dict) -> tuple[dict, list | None]:
        """(metrics, the GAE returns for the critic)."""
        metrics = self.trainer.train(rollout_id, self._read(handle), _merged(value_parts))
        return metrics, self.trainer.get_returns()

    def compute_values(self, handle) -> dict[int, list[float]]:
        return self.trainer.compute_values(self._read(handle))

    def train_critic(self, rollout_id: int, handle, returns: list, *value_parts: dict) -> dict:
        return self.trainer.train_critic(rollout_id, self._read(handle), _merged(value_parts), returns)

    # colocated runs: the trainer's state to host memory and back
    def offload(self) -> int:
        """--offload-train, after a weight update: what the weight transports keep on the device for the engines
        goes (cuda_ipc's exported tensors: loaded by now), then the trainer's state to host memory; returns the
        bytes moved there."""
        released = sum(t.release() for t in self.weight_transports.values())
        if released:
            logger.debug("%s rank %d: released %d bytes the weight transports kept", self.role, self.rank, released)
        return self.trainer.offload()

    # checkpoints
    def publish_checkpoint(self, rollout_id: int, parts: list[str]) -> str:
        """Make iteration `rollout_id`, saved by every role in `parts`, the one a resume starts from."""
        megatron = MegatronConfig.of(self.args)
        from vime.trainer.megatron.checkpoint_files import publish

        return str(publish(megatron.save, rollout_id, retain=megatron.save_retain, parts=parts))

    # weights to the engines, and the probe that checks they arrived
    def send_weights(self, kind: str, handle) -> None:
        """This rank's half of a weight update through the `kind` transport (one instance per kind for the run:
        it keeps what must outlive an update, such as a process group)."""
        from vime.transport.weights import make_sender

        if kind not in self.weight_transports:
            self.weight_transports[kind] = make_sender(kind)
        return self.trainer.send_weights(self.weight_transports[kind], handle)

    # the rank's trainer's own (`MegatronTrainer`'s methods of the same name)
    def onload(self) -> int:
        return self.trainer.onload()

    def save(self, rollout_id: int, extra_state: dict | None = None) -> str:
        return self.trainer.save(rollout_id, extra_state)

    def save_hf(self, out_dir: str) -> str:
        return self.trainer.save_hf(out_dir)

    def get_loaded_state(self) -> dict | None:
        return self.trainer.get_loaded_state()

    def set_plugin_values(self, values: dict) -> None:
        self.trainer.set_plugin_values(values)

    def compute_kind(self) -> tuple[str, str]:
        return self.trainer.compute_kind()

    def probe_log_probs(self, tokens: list[int], response_length: int, temperature: float | None = None,
                        adapter: str | None = None) -> list[float]:
        return self.trainer.probe_log_probs(tokens, response_length, temperature, adapter)


def _merged(parts) -> dict | None:
    merged = {}
    for part in parts:
        merged.update(part)
    return merged or None
