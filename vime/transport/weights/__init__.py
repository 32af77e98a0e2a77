"""Moving the trainer's weights into running engines, behind one small interface (`base`).

Each transport is a package of two halves: `driver.py` (`TransportDriver`: connect to the engines, prepare one
update's handle, the worker calls that load it, cleanup; in the driver, and a copy in the rollout manager) and
`rank.py` (`WeightSender`: send, on every training rank, together). The third half runs inside vLLM:
`vime.engine.in_vllm.worker_extension`, reached through the worker methods the driver names. The driver and every
training rank each hold their half for the whole run (`make_driver`, `make_sender`); the update itself is driven
by `vime.driver.weight_sync`.

Transports: `disk` (HF safetensors into a directory, /dev/shm when available; engines reload it), `broadcast` (in
memory over a gloo/nccl group with the engines' worker extension), `delta` (disk, only the tensors whose content
changed since the last sync), `cuda_ipc` (colocated GPUs: engines map the trainer's tensors), `lora_adapter` (a
LoRA run's adapters alone, served through vLLM's LoRA support; chosen by --lora-sync).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vime.transport.weights.base import DriverSetup, TransportDriver, WeightSender

# kind -> ("module:class" of its driver half, of its rank half), imported when a run makes one; or one class for
# both (registered by a plugin or test). The package itself stays free of torch, so a process that only reads
# `check` or `staging` (the rollout manager, on the engines' start-up path) does not import it; a driver half
# imports none either.
TRANSPORTS: dict[str, tuple[str, str] | type] = {
    "disk": ("disk.driver:DiskDriver", "disk.rank:DiskSender"),
    "broadcast": ("broadcast.driver:BroadcastDriver", "broadcast.rank:BroadcastSender"),
    "delta": ("delta.driver:DeltaDriver", "delta.rank:DeltaSender"),
    "cuda_ipc": ("cuda_ipc.driver:CudaIpcDriver", "cuda_ipc.rank:CudaIpcSender"),
    "lora_adapter": ("lora_adapter.driver:LoraAdapterDriver", "lora_adapter.rank:LoraAdapterSender")}


def _half(kind: str, index: int) -> type:
    try:
        entry = TRANSPORTS[kind]
    except KeyError:
        raise ValueError(f"--update-weight-transport {kind!r}: choose one of {sorted(TRANSPORTS)}") from None
    if isinstance(entry, type):
        return entry
    module, name = entry[index].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def driver_class(kind: str) -> type[TransportDriver]:
    return _half(kind, 0)


def sender_class(kind: str) -> type[WeightSender]:
    return _half(kind, 1)


def make_driver(kind: str, setup: DriverSetup) -> TransportDriver:
    """The driver's half of `kind` (one for the run: `WeightSync`), made with the run's `setup`."""
    return driver_class(kind)(setup)


def make_sender(kind: str) -> WeightSender:
    """A training rank's half of `kind` (one per kind for the run: `TrainActor.send_weights`)."""
    return sender_class(kind)()
