"""Weight sync for colocated GPUs: engines read the trainer's weight tensors straight from its GPU memory.

    python train.py --colocate --update-weight-transport cuda_ipc ...

The writer rank of each pipeline stage exports a CUDA IPC handle per HF-named tensor (torch's own
`reduce_tensor`) into a small file; every engine worker on the same GPU opens the handles and feeds the tensors to
`reload_weights` (`WeightReceiver.vime_load_ipc_weights`), which copies them into the engine's own weights. GPU
only: on CPU use `disk` or `broadcast`. The files are JSON: each tensor's arguments to torch's
`rebuild_cuda_tensor` as plain data (handles as base64, dtypes and the few classes torch puts there by name), so
reading one runs no code (`vime.engine_protocol.ipc_codec`). They live in a private directory of their own under
the weight root, named stage_<stage>.json (the engine's reader, `vime.in_vllm.cuda_ipc`, reads nothing else, from
nowhere else), and are removed after each update.

Memory: the writer keeps the exported tensors (`keepalive`) until `release`: at its next `send` (before the new
copies are made) or when the trainer offloads (`TrainActor.offload`, after the update). Torch counts one consumer
per export (the producer's reference count starts at 1, each process that maps the tensor takes 1 when it lets
go; a count that is not back at 0 keeps the memory in the producer's "limbo" for good), so with several engines
each gets exports of its own, in engine_<i>/ of the update directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from vime.backends.weight_transport.base import Weights, WeightTransport
from vime.backends.weight_transport.staging import stage_dir, write_new_file
from vime.engine_protocol.ipc_codec import encode_rebuild_args
from vime.engine_protocol.weight_files import ENGINE_DIR, engine_dir, manifest, weight_root


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
                os.mkdir(Path(path) / engine_dir(i), 0o700)
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
        return {url: ("vime_load_ipc_weights", {"path": str(Path(handle) / engine_dir(self.engine_urls.index(url)))})
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
        write_new_file(directory, manifest(stage), lambda f: f.write(json.dumps(entries).encode()))
