"""Peak memory of CPU code, as a device allocator would see it: every storage an op creates inside the tracker is
counted from its creation until its last reference goes (a weak reference's callback), so the peak is that of the
live tensors, not of the process (the CPU allocator keeps no statistics; RSS counts caches and libraries).

    with StorageTracker() as tracker:
        step()
    tracker.peak_bytes   # the most bytes the step held at once beyond what existed before it

Storages that existed before (weights, gradient buffers, optimizer state) are not counted: give their size with
`live_bytes(tensors)`. Tensors made without an op (torch.tensor from Python lists, a few KB) are not seen.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StorageTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak_bytes = 0
        self._seen: dict[int, weakref.ref] = {}  # storage data pointer -> its weak reference

    def _count(self, storage) -> None:
        key = storage.data_ptr()
        if not key or key in self._seen:
            return
        size = storage.nbytes()
        self.live += size
        self.peak_bytes = max(self.peak_bytes, self.live)

        def freed(_ref, key=key, size=size):
            if self._seen.pop(key, None) is not None:
                self.live -= size

        self._seen[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in (torch.ops.aten.set_,) or getattr(func, "is_view", False):
            return out
        outputs, _ = tree_flatten(out)
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:  # in-place and out= ops write into storages they were given
                    self._count(storage)
        return out


def live_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
