"""Catch on a CPU machine what only a GPU run would show: tensors of one step on two devices.

A tensor on the `meta` device refuses CPU operands exactly as a CUDA tensor does ("Tensor on device cpu is not on
the expected device meta"; a 0-dim CPU scalar is allowed in both), and it has shapes and dtypes but no values, so
it costs nothing. A test hands the trainer's loss code the model's output (logits, values) on `meta`, as a GPU
model hands it CUDA tensors, and everything the step mixes in from the CPU raises as it would on CUDA.

    logits = model_output_on_meta(rows, vocab)           # what the model returns, "on the GPU"
    loss, metrics = loss_fn(indices, inputs, logits)      # raises where a CPU tensor meets it
    assert_all_on(metrics.values(), "meta")
    with nccl_only(group) as reduced: ...                 # the group refuses CPU tensors, as NCCL does

Values cannot be read back from `meta`: tests that check numbers run the same code on the CPU.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

META = torch.device("meta")
NCCL_REFUSES_CPU = "No backend type associated with device type cpu"


def model_output_on_meta(rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A model output of `rows` x `width` on `meta` that gradients flow into (a leaf)."""
    return torch.empty(rows, width, device=META, dtype=dtype, requires_grad=True)


def assert_all_on(tensors, device) -> None:
    """Every tensor among `tensors` is on `device` (numbers, which any device accepts, pass)."""
    wrong = [t.device for t in tensors if isinstance(t, torch.Tensor) and t.device != torch.device(device)]
    assert not wrong, f"tensors on {sorted(set(map(str, wrong)))}, expected all on {device}"


@contextlib.contextmanager
def nccl_only(*groups):
    """Within the block, `groups` behave as NCCL process groups of one rank: `dist.get_backend` says "nccl" and
    `dist.all_reduce` over them refuses a CPU tensor with NCCL's error (a tensor on any other device is left as it
    is: the sum over one rank). Yields the list of (device, op) of every all-reduce over them."""
    calls: list[tuple[torch.device, object]] = []
    real_all_reduce, real_get_backend = dist.all_reduce, dist.get_backend

    def is_ours(group) -> bool:
        return any(group is g for g in groups)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not is_ours(group):
            return real_all_reduce(tensor, op=op, group=group, async_op=async_op)
        if tensor.device.type == "cpu":
            raise RuntimeError(NCCL_REFUSES_CPU)
        calls.append((tensor.device, op))
        return None

    def get_backend(group=None):
        return "nccl" if is_ours(group) else real_get_backend(group)

    dist.all_reduce, dist.get_backend = all_reduce, get_backend
    try:
        yield calls
    finally:
        dist.all_reduce, dist.get_backend = real_all_reduce, real_get_backend
