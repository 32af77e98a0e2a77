"""The MoE router's losses of one optimizer step, read from megatron-core's aux-loss tracker.

Megatron's routers add each MoE layer's load-balancing and z losses (unweighted) to a process-wide tracker on
every training micro-batch; `take_moe_losses` reduces them over the pipeline and data-parallel ranks, averages
them over the MoE layers and micro-batches, and clears the tracker for the next step. Per layer too, so that an
expert-load imbalance shows where it is: `moe_aux_loss/layer_<i>` (for aux_loss, about 1 when tokens spread
evenly over the experts, higher when they crowd onto a few).
"""

from __future__ import annotations

# Megatron's tracker names -> vime's metric names
_NAMES = {"load_balancing_loss": "moe_aux_loss", "seq_load_balancing_loss": "moe_aux_loss",
          "global_load_balancing_loss": "moe_global_aux_loss", "z_loss": "moe_z_loss"}


def tracked_names(args) -> list[str]:
    """The tracker entries Megatron's routers fill with these flags."""
    names = []
    if (args.moe_aux_loss_coeff or 0) > 0:
        names.append({"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                      "global_aux_loss": "global_load_balancing_loss"}.get(args.moe_router_load_balancing_type, ""))
    if (args.moe_z_loss_coeff or 0) > 0:
        names.append("z_loss")
    return [n for n in names if n]


def take_moe_losses(args, num_micro_batches: int) -> dict[str, float]:
    """{metric: value} of the step just run ({} for a dense model or when no router loss is on). Collective over
    the training ranks: every rank calls it after every optimizer step."""
    import torch

    moe_layers = getattr(args, "moe_layer_freq", None)
    names = tracked_names(args) if getattr(args, "num_experts", None) else []
    if not moe_layers or not names:
        return {}
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    for name in names:  # a stage without MoE layers still takes part in the reductions
        tracker.setdefault(name, {"values": torch.zeros(len(moe_layers)), "reduce_group": None, "avg_group": None,
                                  "reduce_group_has_dp": False})
    reduce_aux_losses_tracker_across_ranks(names)
    layers = [i for i, moe in enumerate(moe_layers) if moe]
    out = {}
    for name in names:
        entry = tracker[name]
        per_layer = (entry["values"].float() / max(num_micro_batches, 1)).tolist()
        metric = _NAMES.get(name, f"moe_{name}")
        out[metric] = sum(per_layer[i] for i in layers) / len(layers)
        out.update({f"{metric}/layer_{i}": per_layer[i] for i in layers})
    clear_aux_losses_tracker()
    return out
