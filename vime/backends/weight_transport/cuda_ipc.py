"""Weight sync for colocated GPUs: engines read the trainer's weight tensors straight from its GPU memory.

    python train.py --colocate --update-weight-transport cuda_ipc ...

The writer rank of each pipeline stage exports a CUDA IPC handle per HF-named tensor (torch's own
`reduce_tensor`) into a small file; every engine worker on the same GPU opens the handles and feeds the tensors to
`reload_weights` (`WeightReceiver.vime_load_ipc_weights`), which copies them into the engine's own weights. GPU
only: on CPU use `disk` or `broadcast`. The files are JSON: each tensor's arguments to torch's
`rebuild_cuda_tensor` as plain data (handles as base64, dtypes and the few classes torch puts there by name), so
reading one runs no code. They live in a private directory of their own under the weight root, named
stage_<stage>.json (`weight_loading.update_files` reads nothing else, from nowhere else), and are removed after
each update.

Memory: the writer keeps the exported tensors (`keepalive`) until `release`: at its next `send` (before the new
copies are made) or when the trainer offloads (`TrainActor.offload`, after the update). Torch counts one consumer
per export (the producer's reference count starts at 1, each process that maps the tensor takes 1 when it lets
go; a count that is not back at 0 keeps the memory in the producer's "limbo" for good), so with several engines
each gets exports of its own, in engine_<i>/ of the update directory.
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
ENGINE_DIR = re.compile(r"engine_(\d+)")  # one engine's manifests, when several engines read an update
MAX_MANIFEST_BYTES = 64 * 2**20  # a few hundred bytes per tensor: anything larger is not one of ours
REBUILD_ARITY = 15  # torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments
TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)
STORAGE_CLASSES = (torch.UntypedStorage, torch.storage.TypedStorage)


class CudaIpcWeightTransport(WeightTransport):
    def __init__(self, args):
        super().__init__(args)
        self.root = weight_root(args)
        self.engine_urls: list[str] = []  # the driver: the engines the next update is for (`connect`)
        self.keepalive: Weights = []  # a writer rank: the tensors engines map, until `release`

    def connect(self, engine_urls: list[str], trainer_address) -> None:
        self.engine_urls = list(engine_urls)

    def prepare(self, version: int) -> str:
        """A new update directory; with several engines, an empty engine_<i>/ in it for each (`connect`'s order)."""
        path = stage_dir(self.root, f"vime_ipc_{version}_")
        if len(self.engine_urls) > 1:
            for i in range(len(self.engine_urls)):
                os.mkdir(Path(path) / f"engine_{i}", 0o700)
        return path

    def send(self, weights: Weights, stage: int | None, handle: str) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        if not torch.cuda.is_available():
            raise RuntimeError("--update-weight-transport cuda_ipc needs GPUs; use disk or broadcast on CPU")
        self.release()  # the last update's: every engine loaded them, and they go before the new copies come
        if stage is not None:  # only a writer's tensors are mapped, so only a writer keeps any
            self.keepalive = [(name, t.detach().contiguous()) for name, t in weights]  # must outlive the reload
            write_manifests(self.keepalive, stage, manifest_dirs(handle), reduce_tensor)
        torch.cuda.synchronize()

    def release(self) -> int:
        """A training rank: drop the exported tensors; returns their bytes. Once the engines loaded an update
        (they copy it into their own weights) nothing needs them. Safe at any time: memory an engine still maps
        stays in torch's limbo until it lets go, and `ipc_collect` frees what was let go since."""
        released = sum(t.nbytes for _, t in self.keepalive)
        self.keepalive = []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        return released

    def bound_engines(self, handle: str) -> list[str] | None:
        """Exports per engine: those `connect` named (an engine restarted since loads the recovery copy)."""
        return list(self.engine_urls) if len(self.engine_urls) > 1 else None

    def load_calls(self, engine_urls: list[str], handle: str) -> dict:
        if len(self.engine_urls) <= 1:
            return {url: ("vime_load_ipc_weights", {"path": handle}) for url in engine_urls}
        unknown = [u for u in engine_urls if u not in self.engine_urls]
        if unknown:  # its exports would be another engine's: torch's count of them would never reach 0
            raise ValueError(f"cuda_ipc: engines {unknown} are not among those this update was exported for "
                             f"({self.engine_urls})")
        return {url: ("vime_load_ipc_weights", {"path": str(Path(handle) / f"engine_{self.engine_urls.index(url)}")})
                for url in engine_urls}

    def cleanup(self, handle: str) -> None:
        shutil.rmtree(handle, ignore_errors=True)


def manifest_dirs(handle: str) -> list[Path]:
    """Where a writer puts its manifests: each engine's engine_<i>/ (in order) when `prepare` made them, else the
    update directory itself."""
    found = sorted((int(m.group(1)), p) for p in Path(handle).iterdir()
                   if p.is_dir() and not p.is_symlink() and (m := ENGINE_DIR.fullmatch(p.name)))
    return [p for _, p in found] or [Path(handle)]


def write_manifests(tensors: Weights, stage: int, dirs: list[Path], reduce) -> None:
    """stage_<stage>.json in each of `dirs`, from exports of its own (`reduce`: torch's `reduce_tensor`): one
    consumer per export, as torch's reference count assumes."""
    for directory in dirs:
        entries = [{"name": name, "args": encode_rebuild_args(reduce(t))} for name, t in tensors]
        write_new_file(directory, f"stage_{stage}.json", lambda f: f.write(json.dumps(entries).encode()))


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
