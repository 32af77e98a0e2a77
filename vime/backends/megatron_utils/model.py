"""Megatron model, optimizer and the two passes the trainer needs: forward-only log-probs and a training step.

Both passes run Megatron's own schedule (`get_forward_backward_func`), so pipeline parallel works unchanged.
Loss and log-probs exist on the last pipeline stage only.
"""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from vime.backends.megatron_utils.batching import pad_tokens
from vime.backends.megatron_utils.log_probs import response_log_probs
from vime.backends.megatron_utils.model_provider import build_model_chunks, params_dtype


def setup_model_and_optimizer(args, total_steps: int, prepare_chunks: Callable | None = None):
    """DDP-wrapped model chunks, Megatron's (optionally distributed) Adam and the LR scheduler.

    `prepare_chunks(chunks)` runs before wrapping: load weights, swap the output head (critic)."""
    chunks = build_model_chunks(args)
    if prepare_chunks is not None:
        prepare_chunks(chunks)
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer, bucket_size=None)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c) for c in chunks]
    dtype = params_dtype(args)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    optimizer = get_megatron_optimizer(opt_config, model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=max(total_steps, 1), lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant")
    # What Megatron-LM's training loop wires up: DP grad all-reduce and embedding-grad sync after backward.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return model, optimizer, scheduler


def _micro_batch_inputs(batch: dict, indices: list[int]):
    tokens, positions = pad_tokens([batch["tokens"][i] for i in indices])
    return tokens, positions


def run_schedule(model, micro_batches: list[list[int]], batch: dict, loss_fn: Callable, forward_only: bool):
    """Run Megatron's schedule over micro-batches of sample indices.

    loss_fn(indices, logits) -> (loss tensor, metrics dict) on the last stage. Returns the list of metrics dicts
    (last stage) or [] (other stages). Sequence lengths vary per micro-batch (variable_seq_lengths)."""
    longest = max(len(batch["tokens"][i]) for mb in micro_batches for i in mb)

    def data_iter():
        for mb in micro_batches:
            yield mb

    def forward_step(iterator, chunk):
        indices = next(iterator)
        tokens, positions = _micro_batch_inputs(batch, indices)
        if torch.cuda.is_available():
            tokens, positions = tokens.cuda(), positions.cuda()
        logits = chunk(tokens, positions, attention_mask=None)

        def loss_func(output):
            return loss_fn(indices, tokens, output)

        return logits, loss_func

    for m in model:
        m.train(not forward_only)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iter(), model=model,
        num_microbatches=len(micro_batches), seq_length=longest, micro_batch_size=1, forward_only=forward_only)


def forward_values(model, batch: dict, micro_batches: list[list[int]]) -> dict[int, torch.Tensor]:
    """Critic: {sample index: values of its response tokens} on the last stage, {} elsewhere."""
    from vime.backends.megatron_utils.critic import response_values

    out: dict[int, torch.Tensor] = {}

    def loss_fn(indices, tokens, output):
        lens = [len(batch["tokens"][i]) for i in indices]
        resp = [batch["response_lengths"][i] for i in indices]
        for i, v in zip(indices, response_values(output, lens, resp)):
            out[i] = v.detach().cpu()
        return torch.zeros((), device=output.device), {}

    with torch.no_grad():
        run_schedule(model, micro_batches, batch, loss_fn, forward_only=True)
    return out


def forward_log_probs(args, model, batch: dict, micro_batches: list[list[int]], with_entropy: bool = False):
    """{sample index: (log-probs of its response tokens, entropy or None)} on the last stage, {} elsewhere."""
    out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def loss_fn(indices, tokens, logits):
        lens = [len(batch["tokens"][i]) for i in indices]
        resp = [batch["response_lengths"][i] for i in indices]
        lps, ents = response_log_probs(logits, tokens, lens, resp, args.rollout_temperature, with_entropy)
        for k, i in enumerate(indices):
            out[i] = (lps[k].detach().cpu(), ents[k].detach().cpu() if ents is not None else None)
        return torch.zeros((), device=logits.device), {}

    with torch.no_grad():
        run_schedule(model, micro_batches, batch, loss_fn, forward_only=True)
    return out


def train_step(args, model, optimizer, scheduler, batch: dict, micro_batches: list[list[int]], loss_fn):
    """One optimizer step over this rank's micro-batches. Returns (metrics list, grad_norm, lr, skipped)."""
    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = run_schedule(model, micro_batches, batch, loss_fn, forward_only=False)
    update_successful, grad_norm, _ = optimizer.step()
    lr = optimizer.param_groups[0]["lr"]
    if update_successful:
        scheduler.step(increment=1)
    return metrics, grad_norm, lr, not update_successful


def is_last_stage() -> bool:
    return parallel_state.is_pipeline_last_stage()
