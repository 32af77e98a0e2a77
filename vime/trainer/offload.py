"""--offload-train: free the trainer's device memory while colocated engines generate, and bring it back.

Everything a rank keeps between rollouts (parameters, DDP param/grad buffers, optimizer state, the KL
reference snapshot) is found by storage: parameters are views into DDP's contiguous buffers, so each
underlying storage is copied to host memory once and then shrunk to zero bytes. Views keep pointing at the
same storage object, so after `onload` (regrow, copy back) Megatron sees exactly the tensors it had.

On GPU this frees device memory for the engines. On CPU the host copy is the same kind of memory, so it
saves nothing; the same code runs so that colocated CPU runs exercise the GPU path's logic. What the weight
transports keep on the device for the engines (cuda_ipc's exported tensors) is dropped by the training actor
before this runs (`TrainActor.offload`).
"""

from __future__ import annotations

from typing import Iterable

import torch


def _optimizer_tensors(optimizer) -> Iterable[torch.Tensor]:
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]  # fp32 main params (shards) of mixed-precision / distributed Adam
        for state in inner.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


def train_state_tensors(model_chunks, optimizer, extra: Iterable[torch.Tensor] = ()) -> Iterable[torch.Tensor]:
    """Every tensor a training rank holds between rollouts."""
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        yield from module.parameters()
        yield from (t for t in module.buffers() if t is not None)  # torch buffers (e.g. rotary tables)
        for p in module.parameters():
            grad = getattr(p, "main_grad", None)
            if grad is not None:
                yield grad
        # Megatron's DDP keeps its contiguous param / grad buffers in an attribute that shadows Module.buffers()
        ddp_buffers = getattr(chunk, "buffers", None)
        ddp_buffers = ddp_buffers if isinstance(ddp_buffers, list) else []
        for buffer in ddp_buffers + list(getattr(chunk, "expert_parallel_buffers", None) or []):
            for name in ("param_data", "grad_data"):
                t = getattr(buffer, name, None)
                if t is not None:
                    yield t
    yield from _optimizer_tensors(optimizer)
    yield from extra


class TrainStateOffloader:
    """offload() moves the storages of the given tensors to host memory; onload() restores them in place."""

    def __init__(self):
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Returns the bytes moved. A second offload without onload is a no-op. Only storages on the device are
        moved (on GPU a host tensor among them stays where it is), each once however many views it has; nothing
        is freed until every copy is made, so a failed copy (host memory) leaves the state as it was."""
        if self._saved:
            return 0
        seen: set[int] = set()
        pin = torch.cuda.is_available()
        device_type = "cuda" if pin else "cpu"  # on CPU the same code runs, freeing nothing (module docstring)
        saved, moved = [], 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.device.type != device_type or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.untyped_storage().copy_(storage, non_blocking=pin)
            saved.append((storage, host))
            moved += storage.nbytes()
        if pin:
            torch.cuda.synchronize()
        for storage, _ in saved:
            storage.resize_(0)  # views stay attached to this storage object
        self._saved = saved
        if pin:
            # a storage once exported to an engine (cuda_ipc) is freed through torch's IPC limbo: collect it, then
            # hand the allocator's cached blocks back to the device, where the engines can take them
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        return moved

    def onload(self) -> int:
        moved = 0
        for storage, host in self._saved:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=True)
            moved += host.numel()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._saved = []
        return moved
