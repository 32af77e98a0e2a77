"""Catch on a CPU machine every place where a GPU step would wait for the device: a host sync.

On CUDA, `torch.cuda.set_sync_debug_mode("error")` raises at each of them: a value read back (`.item()`,
`bool(t)`, `.tolist()`, `.numpy()`, `.cpu()`, `torch.equal`, `nonzero`, boolean-mask indexing, `repeat_interleave`
without `output_size`, `unique`, ...) and a blocking upload (`.to(device)` / `copy_` from host memory without
`non_blocking=True`, `torch.tensor(data, device=...)`). On a CPU machine host and "device" are the same memory, so
this guard tells them apart by where a tensor came from (taint):

- device tensors: those it is given (the model's parameters, gradients, optimizer state, ...), what a `.to(<device>)`
  / `.cuda()` of a host tensor returns, what a factory (`torch.zeros`, `torch.arange`, `torch.tensor`, ...) makes
  with an explicit device other than the string "cpu", and every output of an op that had a device tensor among its
  inputs (autograd's backward ops run through the same dispatcher, so gradients follow);
- host tensors: everything else (the micro-batch layouts `vime.trainer.batching` builds from Python lists, the
  rollout's per-sample tensors): reading them is free, as on a GPU machine.

Where a call names a device, the host is `.cpu()`, the string "cpu", no device, or the `.device` of a host tensor;
any other (the trainer's `training_device()`, a device tensor's `.device`, "cuda") is the device. A host tensor
sent to the device comes back as a copy, so the host original stays a host tensor. Enter the guard before the
device makes anything it keeps (right after building the trainer): a tensor cached earlier (Megatron's rotary
frequencies) would count as the host's.

    with HostSyncGuard(device_tensors) as guard:
        trainer.train(0, groups)
    guard.counts()  # Counter({"megatron.core.optimizer.clip_grads:get_grad_norm_fp32 item": 1, ...})

Where vime's CPU shim for Megatron (`cpu_compat`) stands in for CUDA code, the guard counts what the CUDA code
does: a stream's or event's `synchronize()` is a sync; the MoE token dispatcher's copies of its split sizes to the
host are non-blocking (Megatron waits for them once, at its event's `synchronize()`).

Each event is named by the innermost stack frame in vime or megatron-core (the shim's own frames skipped) and the
kind of sync.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from vime.trainer.megatron import cpu_compat
from vime.trainer.megatron.cpu_compat import _backward_in_mode

aten = torch.ops.aten

# aten ops that read a device tensor's values on the host (CUDA: the host waits for the device)
VALUE_READS = {
    aten._local_scalar_dense.default: "item",  # .item(), bool(t), float(t), int(t), `if t:`
    aten.is_nonzero.default: "item",
    aten.equal.default: "equal",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.bincount.default: "bincount",
}
BOOL_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# the torch functions that make a tensor where their `device=` says
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn, torch.randint,
             torch.randperm, torch.linspace, torch.eye, torch.empty_strided, torch.scalar_tensor, torch.tensor,
             torch.as_tensor}
COPIES_DATA = {torch.tensor, torch.as_tensor}  # from host data: a blocking upload when the device is a GPU
SKIPPED_MODULES = ("vime.trainer.megatron.cpu_compat",)  # CPU stand-ins for Megatron's CUDA code
DEVICE_OF = torch.Tensor.device.__get__  # `t.device`


@dataclass(frozen=True)
class SyncEvent:
    kind: str  # item, tolist, download, blocking upload, ...
    where: str  # module:function of the innermost vime or megatron-core frame

    @property
    def name(self) -> str:
        return f"{self.where} {self.kind}"


def _caller() -> str:
    frame = sys._getframe(1)
    innermost = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("vime.", "megatron.")) and not module.startswith(SKIPPED_MODULES):
            return f"{module}:{frame.f_code.co_qualname}"
        if innermost is None and not module.startswith(("torch", __name__)):
            innermost = f"{module}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return innermost or "?"


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _target(args, kwargs):
    """What a `Tensor.to(...)` call moves its tensor to: a device, a tensor (its device), or None (a dtype)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (torch.Tensor, str, int, torch.device)) and not isinstance(a, bool):
            return a
    return None


class HostSyncGuard:
    """Records every host sync a block would make on a GPU (`events`), the tensors in `device_tensors` and those
    made from them being the device's."""

    def __init__(self, device_tensors: Iterable[torch.Tensor] = ()):
        self.on_device = WeakTensorKeyDictionary()
        self.events: list[SyncEvent] = []
        self.host_devices: dict[int, torch.device] = {}  # the `.device` objects host tensors handed out
        for t in device_tensors:
            self.mark(t)
        self._modes = (_Dispatch(self), _Functions(self))

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        self.on_device[t] = True
        return t

    def is_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.on_device

    def is_host(self, device) -> bool:
        """Whether a call that places a tensor on `device` (or beside a tensor) places it on the host (see the
        module's docstring)."""
        if isinstance(device, torch.Tensor):
            return not self.is_device(device)
        if device is None or (isinstance(device, str) and device.split(":")[0] == "cpu"):
            return True
        return self.host_devices.get(id(device)) is device

    def record(self, kind: str) -> None:
        self.events.append(SyncEvent(kind, _caller()))

    def counts(self) -> Counter:
        return Counter(e.name for e in self.events)

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_as_on_cuda(self))
        for mode in self._modes:
            self._stack.enter_context(mode)
        return self

    def __exit__(self, *exc):
        self._stack.__exit__(*exc)
        self.host_devices.clear()

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` that is the host's."""
        copy = t.clone()
        self.on_device.pop(copy, None)
        return copy


@contextlib.contextmanager
def _as_on_cuda(guard: HostSyncGuard):
    """Within the block, the CPU stand-ins for CUDA streams and events count their `synchronize()` as a sync, and
    the MoE token dispatcher's `maybe_move_tensor_to_cpu` makes host copies without one (non-blocking on CUDA)."""
    from megatron.core.transformer.moe import token_dispatcher

    def synchronize(self, *args, **kwargs):
        guard.record("stream synchronize")

    def non_blocking_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if guard.is_device(tensor):
            tensor = guard.host_copy(tensor)
        return tensor.numpy() if torch.is_tensor(tensor) and as_numpy else tensor

    saved = [(cls, "synchronize", cls.synchronize) for cls in (cpu_compat._HostEvent, cpu_compat._HostStream)]
    saved.append((token_dispatcher, "maybe_move_tensor_to_cpu", token_dispatcher.maybe_move_tensor_to_cpu))
    for owner, name, _ in saved:
        setattr(owner, name, non_blocking_to_host if owner is token_dispatcher else synchronize)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


class _Dispatch(TorchDispatchMode):
    """Every aten op, forward and backward: propagates device taint, records value reads and blocking copies."""

    def __init__(self, guard: HostSyncGuard):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guard = self.guard
        inputs = _tensors((args, kwargs))
        on_device = any(guard.is_device(t) for t in inputs)
        if func in VALUE_READS and on_device:
            guard.record(VALUE_READS[func])
        elif func is aten.repeat_interleave.Tensor and on_device and kwargs.get("output_size") is None:
            guard.record("repeat_interleave without output_size")
        elif func in BOOL_INDEXING and on_device and any(t.dtype in (torch.bool, torch.uint8)
                                                         for t in _tensors(args[1])):
            guard.record("boolean mask index")
        out = func(*args, **kwargs)
        if func is aten.copy_.default:
            self._copy(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        elif on_device:
            for t in _tensors(out):
                guard.mark(t)
        return out

    def _copy(self, dst, src, non_blocking: bool) -> None:
        """`dst.copy_(src)` keeps dst where it is: host to device uploads, device to host downloads."""
        to_device, from_device = self.guard.is_device(dst), self.guard.is_device(src)
        if to_device and not from_device and not non_blocking:
            self.guard.record("blocking upload")
        elif from_device and not to_device and not non_blocking:
            self.guard.record("download")


class _Functions(TorchFunctionMode):
    """The Python-level calls that move data between host and device, which on the CPU reach no aten op (a `.to`
    onto the tensor's own device returns it as it is; `tolist` and `numpy` read memory directly)."""

    def __init__(self, guard: HostSyncGuard):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guard = self.guard
        if func is torch.autograd.backward:  # with this mode on: the Python backward of autograd Functions
            return _backward_in_mode(self, *args, **kwargs)
        if func is torch.Tensor.backward:
            return _backward_in_mode(self, args[0], *args[1:], **{"grad_tensors" if k == "gradient" else k: v
                                                                  for k, v in kwargs.items()})
        if func == DEVICE_OF:
            device = func(*args, **kwargs)
            if not guard.is_device(args[0]):
                guard.host_devices[id(device)] = device  # held: its id names no other object while the guard lives
            return device
        if func in (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__) and guard.is_device(args[0]):
            guard.record(func.__name__.strip("_"))
        elif func is torch.Tensor.cpu and guard.is_device(args[0]):
            return self._download(args[0])
        elif func is torch.Tensor.to:
            target = _target(args, kwargs)
            if target is not None and guard.is_host(target) and guard.is_device(args[0]):
                return self._download(func(*args, **kwargs))
            if target is not None and not guard.is_host(target) and not guard.is_device(args[0]):
                return self._upload(func(*args, **kwargs), args[0], kwargs.get("non_blocking", False))
        elif func is torch.Tensor.cuda and not guard.is_device(args[0]):
            return self._upload(func(*args, **kwargs), args[0], kwargs.get("non_blocking", False))
        elif func is torch.Tensor.new_tensor and guard.is_device(args[0]):
            guard.record("blocking upload")
            return guard.mark(func(*args, **kwargs))
        elif func in FACTORIES and not guard.is_host(kwargs.get("device")):
            data = args[0] if args else kwargs.get("data")
            if func in COPIES_DATA and not guard.is_device(data):
                guard.record("blocking upload")
            return guard.mark(func(*args, **kwargs))
        return func(*args, **kwargs)

    def _upload(self, out: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        if not non_blocking:
            self.guard.record("blocking upload")
        return self.guard.mark(out.clone() if out is src else out)  # the host original stays the host's

    def _download(self, out: torch.Tensor) -> torch.Tensor:
        self.guard.record("download")
        return self.guard.host_copy(out)  # reading it is free


def trainer_device_tensors(trainer) -> list[torch.Tensor]:
    """What a `MegatronTrainer` holds on its device between steps: every model chunk's parameters, buffers and other
    tensor attributes, DDP's parameter and gradient buffers and each parameter's `main_grad` / `.grad`, the
    optimizer's parameters and state (but Adam's `step` counters, which torch keeps on the host), the KL
    reference's and the teacher's weights, the expert-load counters, and megatron-core's process-wide MoE tensors (an
    earlier trainer's, in a test process, live on). (Tensors the trainer makes later on the device are found by the
    guard as they are made.)"""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

    held: list = [MoEAuxLossAutoScaler.main_loss_backward_scale]
    held += [entry.get("values") for entry in get_moe_layer_wise_logging_tracker().values()]
    for chunk in trainer.model:
        for module in chunk.modules():
            held += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
            buffers = getattr(module, "buffers", None)
            for buffer in buffers if isinstance(buffers, list) else []:  # DDP's _ParamAndGradBuffers
                held += [buffer.param_data, buffer.grad_data]
        held += list(chunk.parameters()) + list(torch.nn.Module.buffers(chunk))
        held += [g for p in chunk.parameters() for g in (getattr(p, "main_grad", None), p.grad)]
    for optimizer in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        inner = getattr(optimizer, "optimizer", optimizer)
        held += [p for group in inner.param_groups for p in group["params"]]
        held += [v for state in inner.state.values() for k, v in state.items() if k != "step"]
    held += [v for state in (trainer.ref_state, trainer.teacher_state) for sd in state or [] for v in sd.values()]
    if trainer.expert_load is not None:
        held.append(trainer.expert_load.counts)
    return [t for t in held if isinstance(t, torch.Tensor)]
