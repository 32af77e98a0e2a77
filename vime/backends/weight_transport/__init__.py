"""Moving the trainer's weights into running engines, behind one small interface (`base.WeightTransport`).

A transport has a driver half (`connect` to the engines, `prepare` one update's handle, `cleanup`), a trainer half
(`send`, on every training rank, together) and an engine half (`load_calls`: the worker method and string
kwargs each engine runs to load the update, `vime.backends.weight_transport.worker_extension` inside vLLM). The
driver and every training rank each hold one instance for the whole run (`make_weight_transport`); the update
itself is driven by `vime.ray.weight_sync`.

Implementations: `disk` (HF safetensors into a directory, /dev/shm when available; engines reload it),
`broadcast` (in memory over a gloo/nccl group with the engines' worker extension), `delta` (disk, only the
tensors whose content changed since the last sync), `cuda_ipc` (colocated GPUs: engines map the trainer's tensors).
"""

from __future__ import annotations

from vime.backends.weight_transport.base import WeightTransport
from vime.backends.weight_transport.broadcast import BroadcastWeightTransport
from vime.backends.weight_transport.cuda_ipc import CudaIpcWeightTransport
from vime.backends.weight_transport.delta import DeltaWeightTransport
from vime.backends.weight_transport.disk import DiskWeightTransport

TRANSPORTS: dict[str, type[WeightTransport]] = {
    "disk": DiskWeightTransport, "broadcast": BroadcastWeightTransport, "delta": DeltaWeightTransport,
    "cuda_ipc": CudaIpcWeightTransport}


def make_weight_transport(kind: str, args) -> WeightTransport:
    try:
        cls = TRANSPORTS[kind]
    except KeyError:
        raise ValueError(f"--update-weight-transport {kind!r}: choose one of {sorted(TRANSPORTS)}") from None
    return cls(args)
