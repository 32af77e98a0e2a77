"""A training rank's half of the cuda_ipc transport: the writer of each pipeline stage exports its tensors as CUDA
IPC handles into JSON manifests (`vime.engine.protocol.ipc_codec`), one set per engine, and keeps the tensors
alive until `release`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vime.engine.protocol.ipc_codec import encode_rebuild_args
from vime.engine.protocol.weight_files import ENGINE_DIR, manifest
from vime.transport.weights.base import Weights, WeightSender
from vime.transport.weights.staging import write_new_file


class CudaIpcSender(WeightSender):
    def __init__(self) -> None:
        self.keepalive: Weights = []  # the tensors engines map, until `release`

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
        """Drop the exported tensors; returns their bytes. Once the engines loaded an update (they copy it into
        their own weights) nothing needs them. Safe at any time: memory an engine still maps stays in torch's limbo
        until it lets go, and `ipc_collect` frees what was let go since."""
        released = sum(t.nbytes for _, t in self.keepalive)
        self.keepalive = []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        return released


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
