"""Where a training rank computes, decided in one place, and where its collectives take their tensors.

The model is put on `training_device()` when it is built; everything a step touches follows the model (the loss
copies each micro-batch's batch tensors to the device of the model's output, `TrainBatch.select`), so a CPU test
that runs the model's outputs on another device (tests/helpers/meta_device.py) catches what only a GPU would show.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vime.utils.device import local_device


def training_device() -> torch.device:
    """This rank's device: its current GPU where CUDA is available, else the CPU."""
    return local_device()


def model_device(model) -> torch.device:
    """The device of a model's parameters; `model` is a module or a list of (wrapped) chunks."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return next(p for chunk in chunks for p in chunk.parameters()).device


def backend_takes_cpu(backend: str) -> bool:
    """Whether a process group of this backend (`dist.get_backend`: "gloo", "nccl", "cpu:gloo,cuda:nccl")
    reduces CPU tensors. NCCL refuses them ("No backend type associated with device type cpu")."""
    return "gloo" in backend or "mpi" in backend


def collective_device(group, device) -> torch.device:
    """Where a collective over `group` takes its tensors: the CPU for a group that reduces CPU tensors (gloo: CPU
    runs), else `device`, the rank's own (Megatron's groups on GPUs are NCCL only)."""
    return torch.device("cpu") if backend_takes_cpu(dist.get_backend(group)) else torch.device(device)
