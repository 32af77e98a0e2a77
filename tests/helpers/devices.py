"""Device hygiene for tests of models built by vime's code. On a machine with CUDA, model_provider puts Megatron
models on the GPU (and MegatronTrainer computes there), so a test moves its inputs to the model's device, brings
outputs back to CPU to compare them, and bounds what two computations of the model may differ by with
vime.utils.tolerances' value for the model's device and dtype (CUDA float32 runs partly in TF32).

    tokens = to_device_of(model, tokens)
    assert (got.cpu() - expected).abs().max() < output_tolerance("logprob", model)
"""

from __future__ import annotations

import torch

from vime.utils.tolerances import tolerance


def model_device(model) -> torch.device:
    """The device of `model`'s first parameter; `model` is a module or a list of chunks (build_model_chunks)."""
    first = model[0] if isinstance(model, (list, tuple)) else model
    return next(first.parameters()).device


def to_device_of(model, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(model_device(model))


def _dtype_and_device(model) -> tuple[torch.dtype, str]:
    """A model's parameter dtype and device; without one, what MegatronTrainer computes in for the tests (which
    never pass --bf16 / --fp16): float32, on CUDA when this machine has it."""
    if model is None:
        return torch.float32, "cuda" if torch.cuda.is_available() else "cpu"
    first = model[0] if isinstance(model, (list, tuple)) else model
    param = next(first.parameters())
    return param.dtype, param.device.type


def output_tolerance(kind: str, model=None, cpu: float | None = None) -> float:
    """tolerance(kind, dtype, device) for what `model` computes (None: a MegatronTrainer of this process).

    `cpu`: the bound the test holds a CPU float32 run to where it is not the module's value for `kind` (a test
    measured tighter agreement, or compares a quantity the kind only bounds); kept there, and a floor elsewhere."""
    dtype, device = _dtype_and_device(model)
    if device == "cpu" and dtype == torch.float32 and cpu is not None:
        return cpu
    return max(cpu or 0.0, tolerance(kind, dtype, device))


def trained_weights_tolerance(cpu: float, lr: float, model=None) -> float:
    """Max |difference| allowed between weights that Adam trained two ways (layouts, a restart) with learning
    rate `lr`. On CPU float32: `cpu`, what the test measured. Elsewhere the gradients may differ by the module's
    "grad" tolerance, and Adam moves a weight by about lr x sign(grad) whatever its gradient's size: a weight
    whose gradient is within the kernels' rounding of zero can step the other way, 2 x lr apart."""
    dtype, device = _dtype_and_device(model)
    if device == "cpu" and dtype == torch.float32:
        return cpu
    return max(cpu, 2 * lr, tolerance("grad", dtype, device))
