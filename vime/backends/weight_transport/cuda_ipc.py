"""Weight sync for colocated GPUs: engines read the trainer's weight tensors straight from its GPU memory.

    python train.py --colocate --update-weight-transport cuda_ipc ...

The writer rank of each pipeline stage exports a CUDA IPC handle per HF-named tensor (torch's own
`reduce_tensor`) into a small file; every engine worker on the same GPU opens the handles and feeds the tensors to
`reload_weights` (`WeightReceiver.vime_load_ipc_weights`). The trainer keeps the tensors alive until the next
update. GPU only: on CPU use `disk` or `broadcast`. The handles are pickled (torch's IPC rebuild functions), so the
files live in a private temporary directory and are removed after each update.
"""

from __future__ import annotations

import pickle
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
            entries = [(name, reduce_tensor(t)) for name, t in self.keepalive]
            with open(Path(handle) / f"stage_{stage}.pkl", "wb") as f:
                pickle.dump(entries, f)
        torch.cuda.synchronize()

    def load_calls(self, engine_urls: list[str], handle: str) -> dict:
        return {url: ("vime_load_ipc_weights", {"path": handle}) for url in engine_urls}

    def cleanup(self, handle: str) -> None:
        shutil.rmtree(handle, ignore_errors=True)


def open_ipc_tensors(path: str, device_index: int):
    """Engine side: yield (name, tensor) from the handle files in `path`, mapped onto `device_index`."""
    for file in sorted(Path(path).glob("stage_*.pkl")):
        with open(file, "rb") as f:
            entries = pickle.load(f)  # written by this job's own trainer moments ago
        for name, (rebuild, args) in entries:
            args = list(args)
            args[6] = device_index  # rebuild_cuda_tensor's device: the same GPU may have another index here
            yield name, rebuild(*args)
