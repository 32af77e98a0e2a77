"""Moving the trainer's weights into running engines, behind one small interface.

A transport has two halves: `send(trainer, handle)` runs on every training rank (collectively), and
`load_calls(engine_urls, handle)` (rollout manager) names the worker method and string kwargs each engine runs to
load the update ({url: (method, kwargs)}; an engine left out loads nothing); `prepare(version)` (driver) makes the
handle both get, `cleanup(handle)` (driver) removes what it left. Two optional parts: `connect(engine_urls,
trainer_address)` (driver, before `prepare`) for transports that must know the engines, and `concurrent = True`
for transports whose two halves join one collective and must run at the same time (otherwise loading follows
send). `update_weights` drives one update in two halves: `stage_weights` (trainers send; no pause needed except
for collective transports, so it can overlap generation) and `apply_staged`: one call per engine, all at once
(`client.update_weights_each`), that pauses, runs the load, resets the prefix cache, bumps the weight version
and resumes.

Implementations: `disk` (HF safetensors into a directory, /dev/shm when available; engines reload it),
`broadcast` (in memory over a gloo/nccl group with the engines' worker extension), `delta` (disk, only the
tensors whose content changed since the last sync), `cuda_ipc` (colocated GPUs: engines map the trainer's tensors).

With --use-fault-tolerance every update also leaves a recovery copy, an HF safetensors directory of the new weights
that the rollout manager reloads into an engine it restarts: the update directory itself with `disk`, else one more
`disk` write (`write_recovery_copy`). The manager deletes the previous copy when it gets a new one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime.backends.weight_transport.broadcast import BroadcastWeightTransport
from vime.backends.weight_transport.cuda_ipc import CudaIpcWeightTransport
from vime.backends.weight_transport.delta import DeltaWeightTransport
from vime.backends.weight_transport.disk import DiskWeightTransport

TRANSPORTS = {"disk": DiskWeightTransport, "broadcast": BroadcastWeightTransport, "delta": DeltaWeightTransport,
              "cuda_ipc": CudaIpcWeightTransport}


def get_transport(args):
    try:
        return TRANSPORTS[args.update_weight_transport](args)
    except KeyError:
        raise ValueError(f"--update-weight-transport {args.update_weight_transport!r}: choose one of "
                         f"{sorted(TRANSPORTS)}") from None


@dataclass
class StagedUpdate:
    """A weight update whose trainer half is done (or, for collective transports, ready to start)."""

    transport: Any
    handle: Any
    version: int
    recovery: str | None
    keeps_handle: bool
    stage_time: float


def stage_weights(args, train_group, rollout_manager, version: int) -> StagedUpdate:
    """The trainer half of an update, which needs no pause: the trainers write the new weights where the
    engines will load them from (disk, delta). It can run while the engines still generate; a collective
    transport (broadcast) only prepares here, since its send must meet the engines in `apply_staged`."""
    import ray

    start = time.perf_counter()
    transport = get_transport(args)
    if hasattr(transport, "connect"):
        transport.connect(ray.get(rollout_manager.get_engine_urls.remote()),
                          lambda: ray.get(train_group.actors[0].address.remote()))
    handle = transport.prepare(version)
    keeps_handle = args.use_fault_tolerance and type(transport) is DiskWeightTransport
    recovery = None
    if args.use_fault_tolerance:
        recovery = handle if keeps_handle else write_recovery_copy(args, train_group, version)
    if not getattr(transport, "concurrent", False):
        _wait_all([actor.call.remote("send_weights", transport, handle) for actor in train_group.actors])
    return StagedUpdate(transport, handle, version, recovery, keeps_handle, time.perf_counter() - start)


def apply_staged(args, train_group, rollout_manager, staged: StagedUpdate) -> dict[str, float]:
    """The engine half: pause (in-flight requests finish first; none is lost) -> load -> reset the prefix
    cache -> bump the weight version -> resume. Returns timing metrics of the whole update (pause and load as the
    slowest engine measured them)."""
    import ray

    transport, handle, version = staged.transport, staged.handle, staged.version
    start = time.perf_counter()
    applying = rollout_manager.apply_weights.remote(transport, handle, version, staged.recovery)
    if getattr(transport, "concurrent", False):  # one collective: trainers send while engines receive
        sends = [actor.call.remote("send_weights", transport, handle) for actor in train_group.actors]
        _wait_all(sends + [applying])
    timings = ray.get(applying)
    done = time.perf_counter()
    if not staged.keeps_handle:  # the manager owns (and later deletes) a directory kept for recovery
        transport.cleanup(handle)
    return {"perf/update_weights_time": staged.stage_time + done - start,
            "perf/update_weights_stage_time": staged.stage_time,
            "perf/update_weights_apply_time": done - start,
            "perf/update_weights_pause_time": timings.get("pause_s", 0.0),
            "perf/update_weights_load_time": timings.get("load_s", 0.0)}


def update_weights(args, train_group, rollout_manager, version: int, after: list | None = None) -> dict[str, float]:
    """Push the current policy into every engine. `after`: ObjectRefs (e.g. a rollout still generating) to
    wait for between the trainer half and the engine half, so that writing the weights overlaps them."""
    import ray

    staged = stage_weights(args, train_group, rollout_manager, version)
    if after:
        ray.wait(list(after), num_returns=len(after))
    return apply_staged(args, train_group, rollout_manager, staged)


def write_recovery_copy(args, train_group, version: int) -> str:
    """The current weights as an HF safetensors directory (the `disk` transport's writer), for engine restarts."""
    disk = DiskWeightTransport(args)
    path = Path(disk.root) / f"vime_recovery_{os.getpid()}_{version}"
    path.mkdir(parents=True, exist_ok=True)
    _wait_all([actor.call.remote("send_weights", disk, str(path)) for actor in train_group.actors])
    return str(path)


def _wait_all(refs: list) -> None:
    """ray.get every ref, raising the first failure as soon as it happens: the other members of a collective
    would otherwise sit in it until its timeout."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
