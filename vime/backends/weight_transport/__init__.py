"""Moving the trainer's weights into running engines, behind one small interface (`base.WeightTransport`).

A transport has a driver half (`connect` to the engines, `prepare` one update's handle, `cleanup`), a trainer half
(`send`, on every training rank, together) and an engine half (`load_calls`: the worker method and string
kwargs each engine runs to load the update, `vime.in_vllm.worker_extension` inside vLLM). The
driver and every training rank each hold one instance for the whole run (`make_weight_transport`); the update
itself is driven by `vime.ray.weight_sync`.

Implementations: `disk` (HF safetensors into a directory, /dev/shm when available; engines reload it),
`broadcast` (in memory over a gloo/nccl group with the engines' worker extension), `delta` (disk, only the
tensors whose content changed since the last sync), `cuda_ipc` (colocated GPUs: engines map the trainer's tensors),
`lora_adapter` (a LoRA run's adapters alone, served through vLLM's LoRA support; chosen by --lora-sync).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vime.backends.weight_transport.base import WeightTransport

# kind -> "module:class" (imported when a run makes one) or a class (registered by a plugin or test): the package
# itself stays free of torch, so a process that only reads `check` or `staging` (the rollout manager, on the
# engines' start-up path) does not import it.
TRANSPORTS: dict[str, str | type] = {
    "disk": "disk:DiskWeightTransport", "broadcast": "broadcast:BroadcastWeightTransport",
    "delta": "delta:DeltaWeightTransport", "cuda_ipc": "cuda_ipc:CudaIpcWeightTransport",
    "lora_adapter": "lora_adapter:LoraAdapterTransport"}


def transport_class(kind: str) -> type[WeightTransport]:
    try:
        entry = TRANSPORTS[kind]
    except KeyError:
        raise ValueError(f"--update-weight-transport {kind!r}: choose one of {sorted(TRANSPORTS)}") from None
    if not isinstance(entry, str):
        return entry
    module, name = entry.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def make_weight_transport(kind: str, args) -> WeightTransport:
    return transport_class(kind)(args)
