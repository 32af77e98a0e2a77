"""Weight sync for colocated GPUs: engines read the trainer's weight tensors straight from its GPU memory.

    python train.py --colocate --update-weight-transport cuda_ipc ...

The writer rank of each pipeline stage exports a CUDA IPC handle per HF-named tensor (torch's own
`reduce_tensor`) into a small file; every engine worker on the same GPU opens the handles and feeds the tensors to
`reload_weights` (`WeightReceiver.vime_load_ipc_weights`). The trainer keeps the tensors alive until the next
update. GPU only: on CPU use `disk` or `broadcast`. The files are JSON: each tensor's arguments to torch's
`rebuild_cuda_tensor` as plain data (handles as base64, dtypes and the few classes torch puts there by name), so
reading one runs no code. They live in a private directory of their own under the weight root, named
stage_<stage>.json (`weight_loading.update_files` reads nothing else, from nowhere else), and are removed after
each update.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path

import torch

from vime.backends.vllm_utils.weight_loading import update_files, weight_root
from vime.backends.weight_transport.base import Weights, WeightTransport
from vime.backends.weight_transport.staging import stage_dir, write_new_file

MANIFEST = re.compile(r"stage_(\d+)\.json")  # one per pipeline stage; the only names in an update directory
MAX_MANIFEST_BYTES = 64 * 2**20  # a few hundred bytes per tensor: anything larger is not one of ours
REBUILD_ARITY = 15  # torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments
TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)
STORAGE_CLASSES = (torch.UntypedStorage, torch.storage.TypedStorage)


class CudaIpcWeightTransport(WeightTransport):
    def __init__(self, args):
        super().__init__(args)
        self.root = weight_root(args)
        self.keepalive: Weights = []  # a training rank: the tensors engines map, alive until the next update

    def prepare(self, version: int) -> str:
        return stage_dir(self.root, f"vime_ipc_{version}_")

    def send(self, weights: Weights, stage: int | None, handle: str) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        if not torch.cuda.is_available():
            raise RuntimeError("--update-weight-transport cuda_ipc needs GPUs; use disk or broadcast on CPU")
        self.keepalive = [(name, t.detach().contiguous()) for name, t in weights]  # must outlive the reload
        if stage is not None:
            entries = [{"name": name, "args": encode_rebuild_args(reduce_tensor(t))} for name, t in self.keepalive]
            write_new_file(Path(handle), f"stage_{stage}.json", lambda f: f.write(json.dumps(entries).encode()))
        torch.cuda.synchronize()

    def load_calls(self, engine_urls: list[str], handle: str) -> dict:
        return {url: ("vime_load_ipc_weights", {"path": handle}) for url in engine_urls}

    def cleanup(self, handle: str) -> None:
        shutil.rmtree(handle, ignore_errors=True)


def _classes() -> dict[str, type]:
    """The classes `reduce_tensor` puts in rebuild_cuda_tensor's arguments, by name: nothing else is accepted."""
    return {"torch.Tensor": torch.Tensor, "torch.nn.Parameter": torch.nn.Parameter,
            "torch.UntypedStorage": torch.UntypedStorage, "torch.storage.TypedStorage": torch.storage.TypedStorage}


def encode_rebuild_args(reduced) -> list:
    """torch's `reduce_tensor(t)` of a CUDA tensor -> JSON-able rebuild arguments (each value tagged with its kind)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    rebuild, args = reduced
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"cuda_ipc sends CUDA tensors only; torch reduced one with {rebuild.__name__}")
    names = {cls: name for name, cls in _classes().items()}
    out = []
    for value in args:
        if isinstance(value, type):
            out.append(["class", names[value]])
        elif isinstance(value, torch.dtype):
            out.append(["dtype", str(value).removeprefix("torch.")])
        elif isinstance(value, bytes):
            out.append(["bytes", base64.b64encode(value).decode()])
        elif isinstance(value, tuple):  # torch.Size, strides
            out.append(["ints", [int(v) for v in value]])
        elif value is None or isinstance(value, (bool, int, float)):
            out.append(["plain", value])
        else:
            raise TypeError(f"cuda_ipc: unexpected {type(value).__name__} in torch's rebuild arguments")
    return out


def decode_rebuild_args(encoded: list) -> list:
    """Inverse of `encode_rebuild_args`; refuses any kind, class or argument list torch's would not have."""
    classes, out = _classes(), []
    for kind, value in encoded:
        if kind == "class":
            if value not in classes:
                raise KeyError(f"cuda_ipc: {value!r} is none of the classes torch's rebuild arguments hold")
            out.append(classes[value])
        elif kind == "dtype":
            dtype = getattr(torch, value, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"cuda_ipc: {value!r} is not a torch dtype")
            out.append(dtype)
        elif kind == "bytes":
            out.append(base64.b64decode(value, validate=True))
        elif kind == "ints":
            out.append(tuple(int(v) for v in value))
        elif kind == "plain" and (value is None or isinstance(value, (bool, int, float))):
            out.append(value)
        else:
            raise ValueError(f"cuda_ipc: unknown argument kind {kind!r} (or a {type(value).__name__} as plain)")
    if len(out) != REBUILD_ARITY or out[0] not in TENSOR_CLASSES or out[4] not in STORAGE_CLASSES \
            or not isinstance(out[5], torch.dtype):
        raise ValueError("cuda_ipc: not rebuild_cuda_tensor's arguments (tensor class, size, stride, offset, "
                         "storage class, dtype, device, handle, ...)")
    out[1] = torch.Size(out[1])  # tensor_size
    return out


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
