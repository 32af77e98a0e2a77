"""The MoE routers' losses and expert loads of one optimizer step.

Megatron's routers add each MoE layer's load-balancing and z losses (unweighted) to a process-wide tracker on
every training micro-batch; `take_moe_losses` reduces them over the pipeline and data-parallel ranks, averages
them over the MoE layers and micro-batches, and clears the tracker for the next step. Per layer too, so that an
expert-load imbalance shows where it is: `moe_aux_loss/layer_<i>` (for aux_loss, about 1 when tokens spread
evenly over the experts, higher when they crowd onto a few).

`ExpertLoad` counts the tokens each router sends to each expert in the training forwards (a hook on every
router; log-prob forwards run without gradients and are not counted) and reports per layer the load imbalance
`moe_load_imbalance/layer_<i>`: the busiest expert's tokens over the mean (1.0 = even; the number of experts =
every token on one expert), whatever the load-balancing loss, so also for DeepSeek-V3's aux-loss-free bias.
"""

from __future__ import annotations

import torch

from vime.config.train import MegatronConfig

# Megatron's tracker names -> vime's metric names
_NAMES = {"load_balancing_loss": "moe_aux_loss", "seq_load_balancing_loss": "moe_aux_loss",
          "global_load_balancing_loss": "moe_global_aux_loss", "z_loss": "moe_z_loss"}


def tracked_names(args) -> list[str]:
    """The tracker entries Megatron's routers fill with these flags."""
    megatron = MegatronConfig.of(args)
    names = []
    if (megatron.moe_aux_loss_coeff or 0) > 0:
        names.append({"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                      "global_aux_loss": "global_load_balancing_loss"}.get(megatron.moe_router_load_balancing_type, ""))
    if (megatron.moe_z_loss_coeff or 0) > 0:
        names.append("z_loss")
    return [n for n in names if n]


def take_moe_losses(args, num_micro_batches: int, device) -> dict[str, torch.Tensor]:
    """{metric: 0-dim tensor} of the step just run ({} for a dense model or when no router loss is on), on
    `device`, the model's (read once with the step's other metrics). Collective over the training ranks: every
    rank calls it after every optimizer step."""
    megatron = MegatronConfig.of(args)
    moe_layers = megatron.moe_layer_freq
    names = tracked_names(args) if megatron.num_experts else []
    if not moe_layers or not names:
        return {}
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    for name in names:  # a stage without MoE layers still takes part in the reductions, which are NCCL on GPUs:
        # its stand-in entry lives where the routers' own entries do, on the model's device
        tracker.setdefault(name, {"values": torch.zeros(len(moe_layers), device=device), "reduce_group": None,
                                  "avg_group": None, "reduce_group_has_dp": False})
    reduce_aux_losses_tracker_across_ranks(names)
    layers = [i for i, moe in enumerate(moe_layers) if moe]
    out = {}
    for name in names:
        per_layer = tracker[name]["values"].float() / max(num_micro_batches, 1)
        metric = _NAMES.get(name, f"moe_{name}")
        out[metric] = per_layer[layers].mean()
        out.update({f"{metric}/layer_{i}": per_layer[i] for i in layers})
    clear_aux_losses_tracker()
    return out


class ExpertLoad:
    """Tokens per expert of each MoE layer over the training forwards since the last `take`."""

    def __init__(self, model_chunks: list[torch.nn.Module], num_layers: int, num_experts: int):
        from megatron.core.transformer.moe.router import TopKRouter

        from vime.trainer.megatron.device import model_device
        from vime.trainer.megatron.multi_token_prediction import decoder_modules

        # on the routers' device, so that counting stays asynchronous on a GPU (one copy per step, in `take`)
        device = model_device(model_chunks)
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.moe_layers: set[int] = set()
        for chunk in model_chunks:
            for module in decoder_modules(chunk):
                if isinstance(module, TopKRouter):
                    self.moe_layers.add(module.layer_number - 1)
                    module.register_forward_hook(self._count)

    def _count(self, router, inputs, outputs) -> None:
        if torch.is_grad_enabled():  # a training forward
            _, routing_map = outputs  # [tokens, experts] bool
            self.counts[router.layer_number - 1] += routing_map.sum(dim=0)

    def take(self) -> dict[str, float]:
        """{"moe_load_imbalance": mean over MoE layers, "moe_load_imbalance/layer_<i>": ...}; the counts summed
        over the data-parallel ranks (their own tokens; expert-parallel ranks are among them) and the pipeline
        stages (their own layers), then reset. Collective over the training ranks, like `take_moe_losses`."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        counts = self.counts.clone()
        self.counts.zero_()
        if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
            dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
            dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
        counts = counts.cpu()
        layers = [i for i in range(len(counts)) if counts[i].sum() > 0]
        if not layers:
            return {}
        per_layer = {i: (counts[i].max() / counts[i].mean()).item() for i in layers}
        return {"moe_load_imbalance": sum(per_layer.values()) / len(per_layer),
                **{f"moe_load_imbalance/layer_{i}": v for i, v in per_layer.items()}}
