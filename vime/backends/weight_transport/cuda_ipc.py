"""Weight sync for colocated GPUs: engines read the trainer's weight tensors straight from its GPU memory.

    python train.py --colocate --update-weight-transport cuda_ipc ...

The writer rank of each pipeline stage exports a CUDA IPC handle per HF-named tensor (torch's own
`reduce_tensor`) into a small file; every engine worker on the same GPU opens the handles and feeds the tensors to
`reload_weights` (`WeightReceiver.vime_load_ipc_weights`). The trainer keeps the tensors alive until the next
update. GPU only: on CPU use `disk` or `broadcast`. The files are JSON: each tensor's arguments to torch's
`rebuild_cuda_tensor` as plain data (handles as base64, dtypes and the few classes torch puts there by name), so
reading one runs no code; they live in a private temporary directory and are removed after each update.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
from pathlib import Path

import torch

from vime.backends.weight_transport.base import Weights, WeightTransport
from vime.backends.weight_transport.disk import default_weight_dir


class CudaIpcWeightTransport(WeightTransport):
    def __init__(self, args):
        super().__init__(args)
        self.root = getattr(args, "update_weight_dir", None) or default_weight_dir()
        self.keepalive: Weights = []  # a training rank: the tensors engines map, alive until the next update

    def prepare(self, version: int) -> str:
        return tempfile.mkdtemp(prefix=f"vime_ipc_{version}_", dir=self.root)

    def send(self, weights: Weights, stage: int | None, handle: str) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        if not torch.cuda.is_available():
            raise RuntimeError("--update-weight-transport cuda_ipc needs GPUs; use disk or broadcast on CPU")
        self.keepalive = [(name, t.detach().contiguous()) for name, t in weights]  # must outlive the reload
        if stage is not None:
            entries = [{"name": name, "args": encode_rebuild_args(reduce_tensor(t))} for name, t in self.keepalive]
            (Path(handle) / f"stage_{stage}.json").write_text(json.dumps(entries))
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
    """Inverse of `encode_rebuild_args`; refuses any kind or class it does not know."""
    classes, out = _classes(), []
    for kind, value in encoded:
        if kind == "class":
            out.append(classes[value])
        elif kind == "dtype":
            dtype = getattr(torch, value, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"cuda_ipc: {value!r} is not a torch dtype")
            out.append(dtype)
        elif kind == "bytes":
            out.append(base64.b64decode(value))
        elif kind == "ints":
            out.append(tuple(int(v) for v in value))
        elif kind == "plain":
            out.append(value)
        else:
            raise ValueError(f"cuda_ipc: unknown argument kind {kind!r}")
    out[1] = torch.Size(out[1])  # tensor_size
    return out


def open_ipc_tensors(path: str, device_index: int):
    """Engine side: yield (name, tensor) from the handle files in `path`, mapped onto `device_index`."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    for file in sorted(Path(path).glob("stage_*.json")):
        for entry in json.loads(file.read_text()):
            args = decode_rebuild_args(entry["args"])
            args[6] = device_index  # rebuild_cuda_tensor's device: the same GPU may have another index here
            yield entry["name"], rebuild_cuda_tensor(*args)
