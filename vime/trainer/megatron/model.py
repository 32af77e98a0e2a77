"""Megatron model chunks ready to train: built, prepared (weights loaded, heads swapped), DDP-wrapped, with
Megatron's optimizer and LR scheduler. The passes that run them are the trainer's (`vime.trainer.passes`).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from vime.config.train import MegatronConfig
from vime.trainer.megatron.foreach_kernels import use_foreach_kernels
from vime.trainer.megatron.megatron_flags import given_fields
from vime.trainer.megatron.model_provider import build_model_chunks, params_dtype


class _CollectableDDP(DistributedDataParallel):
    """Megatron's DDP, whose gradient hooks hold it weakly. Each parameter's gradient accumulator (a C++ autograd
    node, opaque to Python's gc) gets a hook closing over the DDP; held strongly, a torn-down model and the ~15 gloo
    groups its config holds (a thread and sockets each) would live until the process exits. The DDP holds its
    hooks itself, so they live exactly as long as it does."""

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        hook = super()._make_backward_post_hook(param)
        self.__dict__.setdefault("_vime_backward_post_hooks", []).append(hook)
        held = weakref.ref(hook)

        def weak_hook(*args, **kwargs):
            live = held()
            return None if live is None else live(*args, **kwargs)

        return weak_hook


def setup_model_and_optimizer(args, total_steps: int, prepare_chunks: Callable | None = None):
    """DDP-wrapped model chunks, Megatron's (optionally distributed) Adam and the LR scheduler.

    `prepare_chunks(chunks)` runs before wrapping: load weights, swap the output head (critic)."""
    megatron = MegatronConfig.of(args)
    chunks = build_model_chunks(args)
    if prepare_chunks is not None:
        prepare_chunks(chunks)
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(**{
        "grad_reduce_in_fp32": True, "overlap_grad_reduce": False, "bucket_size": None,
        **given_fields(args, "ddp"), "use_distributed_optimizer": megatron.use_distributed_optimizer})
    model = [_CollectableDDP(config=config, ddp_config=ddp_config, module=c) for c in chunks]
    dtype = params_dtype(args)
    opt_config = OptimizerConfig(**{
        "optimizer": "adam", **given_fields(args, "optimizer"), "lr": megatron.lr, "min_lr": megatron.min_lr,
        "weight_decay": megatron.weight_decay, "adam_beta1": megatron.adam_beta1, "adam_beta2": megatron.adam_beta2,
        "adam_eps": megatron.adam_eps, "clip_grad": megatron.clip_grad,
        "use_distributed_optimizer": megatron.use_distributed_optimizer, "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16})
    use_foreach_kernels()  # without apex / TransformerEngine: no host read per gradient tensor in clipping
    optimizer = get_megatron_optimizer(opt_config, model)
    use_fused_adam(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if megatron.lr_warmup_iters else megatron.lr, max_lr=megatron.lr, min_lr=megatron.min_lr,
        lr_warmup_steps=megatron.lr_warmup_iters, lr_decay_steps=max(total_steps, 1),
        lr_decay_style=megatron.lr_decay_style,
        start_wd=megatron.weight_decay, end_wd=megatron.weight_decay, wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant")
    # What Megatron-LM's training loop wires up: DP grad all-reduce and embedding-grad sync after backward.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return model, optimizer, scheduler


def use_fused_adam(optimizer) -> None:
    """Switch the torch Adam(W) that Megatron falls back to without TransformerEngine or Apex to torch's fused
    kernel (one pass over each tensor; Megatron builds it with torch's default, a Python loop on CPU)."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue  # TransformerEngine's or Apex's FusedAdam already is
        for group in inner.param_groups:
            if not group.get("differentiable") and all(p.dtype.is_floating_point for p in group["params"]):
                group["foreach"], group["fused"] = False, True
