"""One weight update, driven from the driver: the trainers send, every engine loads, the version moves on.

    sync = WeightSync(setup, lora, recovery_copies=..., rollout_timeout=..., train_timeout=...)  # one for the run
    metrics = sync.update(trainers, manager, version, after=[rollout_ref])

An update has two halves. `stage` (the trainers write the new weights where the engines will load them from;
no pause needed, so it can overlap generation; a collective transport only prepares here) and `apply`: one call
per engine, all at once (`client.update_weights_each` in the rollout manager), that pauses, loads, resets the
prefix cache, bumps the weight version and resumes. A collective transport (broadcast) sends during `apply`,
since its send must meet the engines in the same group.

With --use-fault-tolerance every update also leaves a recovery copy, an HF safetensors directory of the new weights
that the rollout manager reloads into an engine it restarts: the update directory itself when the transport writes
one (`disk`; a LoRA run's adapter), else one more `disk` write. The manager deletes the previous copy when it
gets a new one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray

from vime.config import RunConfig
from vime.config.train import LoraConfig, WeightSyncConfig
from vime.engine.control.engine import has_vime_worker_extension
from vime.transport.weights import make_driver
from vime.transport.weights.base import DriverSetup
from vime.transport.weights.staging import stage_dir
from vime.utils.deadline import DeadlineExceeded, control, gather

RECOVERY = "disk"  # the transport that writes recovery copies


@dataclass
class StagedUpdate:
    """A weight update whose trainer half is done (or, for collective transports, ready to start)."""

    handle: Any
    version: int
    recovery: str | None
    stage_time: float


def sync_kind(weight_sync: WeightSyncConfig, lora: LoraConfig) -> str:
    """The transport of the run's weight updates: --update-weight-transport, or a LoRA run's adapter sync (the flags'
    validation resolves --lora-sync for LoRA runs only)."""
    if lora.lora_sync == "adapter":
        return "lora_adapter"
    return weight_sync.update_weight_transport


class WeightSync:
    """The driver's side of the run's weight updates. `setup`: what the transports' driver halves are made with;
    `lora`: a LoRA run syncs its adapters; `recovery_copies` (--use-fault-tolerance): every update leaves one;
    `rollout_timeout`, `train_timeout`: how long an update waits for a rollout, and for the trainers."""

    def __init__(self, setup: DriverSetup, lora: LoraConfig, *, recovery_copies: bool, rollout_timeout: float,
                 train_timeout: float):
        self.kind = sync_kind(setup.weight_sync, lora)
        self.transport = make_driver(self.kind, setup)
        self.recovery_writer = make_driver(RECOVERY, setup) if recovery_copies else None
        self.rollout_timeout, self.train_timeout = rollout_timeout, train_timeout

    @classmethod
    def for_run(cls, config: RunConfig, args) -> WeightSync:
        """The run's, from its sections (and its engines' flags: whether they run vime's worker methods)."""
        setup = DriverSetup(config.weight_sync, config.megatron, config.engines, has_vime_worker_extension(args))
        return cls(setup, config.lora, recovery_copies=config.fault_tolerance.use_fault_tolerance,
                   rollout_timeout=config.rollout.rollout_timeout, train_timeout=config.job.train_timeout)

    @property
    def keeps_handle(self) -> bool:
        """The update directory doubles as the recovery copy (the manager owns and later deletes it)."""
        return self.recovery_writer is not None and self.transport.update_is_recovery_copy

    def update(self, train_group, rollout_manager, version: int, after: list | None = None,
               in_flight: bool = False) -> dict[str, float]:
        """Push the current policy into every engine. `after`: ObjectRefs (e.g. a rollout still generating) to
        wait for between the trainer half and the engine half, so that writing the weights overlaps them.
        `in_flight`: do not wait; the engines load between decode steps of the requests they are running, which
        continue under the new weights (`apply`'s pause mode "keep")."""
        staged = self.stage(train_group, rollout_manager, version)
        if in_flight:
            return self.apply(train_group, rollout_manager, staged, pause_mode="keep")
        if after:
            _, unfinished = ray.wait(list(after), num_returns=len(after), timeout=self.rollout_timeout)
            if unfinished:
                raise DeadlineExceeded(f"the rollout weight update {version} waits for did not finish within "
                                       f"--rollout-timeout {self.rollout_timeout:g}s")
        return self.apply(train_group, rollout_manager, staged)

    def stage(self, train_group, rollout_manager, version: int) -> StagedUpdate:
        """The trainer half, which needs no pause."""
        start = time.perf_counter()
        # a collective's members must all be alive: its engines are probed first
        urls = (rollout_manager.get_live_engine_urls if self.transport.concurrent else
                rollout_manager.get_engine_urls).remote()
        self.transport.connect(control(urls, "the engine URLs"),
                               lambda: control(train_group.actors[0].address.remote(), "training rank 0's address"))
        handle = self.transport.prepare(version)
        recovery = None
        if self.recovery_writer is not None:
            recovery = handle if self.keeps_handle else self._write_recovery_copy(train_group, version)
        if not self.transport.concurrent:
            self._wait([a.send_weights.remote(self.kind, handle) for a in train_group.actors], version, "write")
        return StagedUpdate(handle, version, recovery, time.perf_counter() - start)

    def apply(self, train_group, rollout_manager, staged: StagedUpdate, pause_mode: str = "wait") -> dict[str, float]:
        """The engine half: pause (`pause_mode` "wait": in-flight requests finish first; "keep": they stay, and
        continue under the new weights with their KV recomputed; none is lost) -> load -> reset the prefix cache
        -> bump the weight version -> resume. Returns timing metrics of the whole update (pause and load as the
        slowest engine measured them)."""
        start = time.perf_counter()
        applying = rollout_manager.apply_weights.remote(self.transport, staged.handle, staged.version,
                                                        staged.recovery, pause_mode)
        if self.transport.concurrent:  # one collective: trainers send while engines receive
            self._wait([a.send_weights.remote(self.kind, staged.handle) for a in train_group.actors] + [applying],
                       staged.version, "send")
        timings = self._wait(applying, staged.version, "load")
        done = time.perf_counter()
        if not self.keeps_handle:
            self.transport.cleanup(staged.handle)
        return {"perf/update_weights_time": staged.stage_time + done - start,
                "perf/update_weights_stage_time": staged.stage_time,
                "perf/update_weights_apply_time": done - start,
                "perf/update_weights_pause_time": timings.get("pause_s", 0.0),
                "perf/update_weights_load_time": timings.get("load_s", 0.0)}

    def _write_recovery_copy(self, train_group, version: int) -> str:
        """The current weights as an HF safetensors directory (the `disk` transport's writer), for engine restarts:
        a new private directory under the weight root, like every update's."""
        path = stage_dir(self.recovery_writer.root, f"vime_recovery_{version}_")
        self._wait([a.send_weights.remote(RECOVERY, path) for a in train_group.actors], version, "recovery copy")
        return path

    def _wait(self, refs, version: int, what: str):
        return gather(refs, f"the {what} of weight update {version} ({self.kind})", self.train_timeout,
                      "--train-timeout")
