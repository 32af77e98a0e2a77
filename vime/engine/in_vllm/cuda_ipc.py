"""The engine half of the cuda_ipc weight transport (`vime.transport.weights.cuda_ipc`): a worker maps
the training writer's exported tensors from the JSON manifests in an update directory
(`WeightReceiver.vime_load_ipc_weights`)."""

from __future__ import annotations

import json
import os

from vime.engine.in_vllm.weight_loading import update_files
from vime.engine.protocol.ipc_codec import decode_rebuild_args
from vime.engine.protocol.weight_files import MANIFEST

MAX_MANIFEST_BYTES = 64 * 2**20  # a few hundred bytes per tensor: anything larger is not one of ours


def read_manifests(path: str) -> list[tuple[str, list]]:
    """Engine side: [(name, rebuild arguments)] from the stage_<s>.json files of update directory `path` (inside
    the weight root: `weight_loading.update_files`), all read and checked before any tensor is mapped."""
    entries = []
    for file in update_files(path, MANIFEST):
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        try:
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ValueError(f"larger than {MAX_MANIFEST_BYTES} bytes")
            entries += [(str(e["name"]), decode_rebuild_args(e["args"])) for e in json.loads(raw)]
        except (ValueError, KeyError, TypeError) as e:  # JSON's errors are ValueErrors
            raise ValueError(f"{file} is not a CUDA IPC manifest that vime wrote ({e}); nothing was loaded") from e
    return entries


def open_ipc_tensors(path: str, device_index: int):
    """Engine side: (name, tensor) for each handle in `path`, mapped onto `device_index` as it is consumed."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    entries = read_manifests(path)  # now, not at the first tensor: a bad file fails before anything is loaded

    def tensors():
        for name, args in entries:
            args[6] = device_index  # rebuild_cuda_tensor's device: the same GPU may have another index here
            yield name, rebuild_cuda_tensor(*args)

    return tensors()
