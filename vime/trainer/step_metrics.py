"""One rollout's step metrics, from micro-batch shares to the floats the driver logs.

Each micro-batch's loss function reports its share of the step's global mean (`loss.make_loss_fn`), so a step's
metric is the sum over micro-batches and data-parallel ranks, except those in `MAX_METRICS` (their maximum). They
stay 0-dim device tensors until the rollout ends, when `read_metrics` reads them with one host copy per device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from vime.trainer.megatron.device import collective_device
from vime.trainer.passes import is_last_stage

# step metrics reduced by their maximum (the others are shares of a global mean: summed)
MAX_METRICS = frozenset({"logprob_diff_max"})


def reduce_step_metrics(mb_metrics: list[dict], dp_size: int, device) -> dict[str, torch.Tensor]:
    """Sum the micro-batch shares (the max for `MAX_METRICS`), then over data-parallel ranks (last stage only):
    0-dim tensors, not read here. `device` is the rank's model's; the all-reduce takes them on the device its group
    serves: Megatron's data-parallel group on GPUs is NCCL only."""
    if not is_last_stage() or not mb_metrics:
        return {}
    group = parallel_state.get_data_parallel_group()
    keys = sorted(mb_metrics[0])
    sums, maxes = metric_totals(mb_metrics, keys, collective_device(group, device))
    if dp_size > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    return {k: maxes[j] if k in MAX_METRICS else sums[j] for j, k in enumerate(keys)}


def metric_totals(mb_metrics: list[dict], keys: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(keys)] sums and maxima over the micro-batches of each metric (a tensor on any device, or a number a
    custom loss returned), on `device`: copies, no host sync."""
    table = torch.stack([torch.stack([torch.as_tensor(m[k]).detach().float().reshape(()).to(device, non_blocking=True)
                                      for k in keys]) for m in mb_metrics])
    return table.sum(dim=0), table.amax(dim=0)


def reports_metrics() -> bool:
    """Whether this rank returns the rollout's metrics: tensor-parallel rank 0 of the last pipeline stage (in each
    data-parallel replica: they hold the same reduced numbers, and the driver keeps the first)."""
    return is_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0


def read_metrics(metrics: dict) -> dict[str, float]:
    """A rollout's metrics as floats, the tensors among them read with one host copy per device."""
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    for device in {v.device for v in tensors.values()}:
        names = [k for k, v in tensors.items() if v.device == device]
        out.update(zip(names, torch.stack([tensors[k].detach().float().reshape(()) for k in names]).tolist()))
    return {k: out[k] for k in metrics}
