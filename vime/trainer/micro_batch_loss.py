"""The per-micro-batch RL loss, built from the pure functions in `vime.algorithms`.

Each micro-batch returns its share of the step's global mean (denominators count every trainable token or
sequence of the step across data-parallel ranks), so summing micro-batches and ranks gives the global loss.
Megatron divides a returned loss by the local micro-batch count and DDP averages over data-parallel ranks;
`scale` undoes both.
"""

from __future__ import annotations

import torch

from vime.algorithms import aggregate_loss, compute_approx_kl, get_policy_loss
from vime.algorithms.losses import top_entropy_mask
from vime.algorithms.rollout_correction import compute_mis_weights, truncated_weights
from vime.config.algorithm import AlgorithmConfig, DistillationConfig, RolloutCorrectionConfig
from vime.config.rollout import RolloutConfig
from vime.config.run import JobConfig
from vime.config.train import MegatronConfig
from vime.trainer.log_probs import response_log_probs
from vime.trainer.train_batch import TrainBatch
from vime.utils.misc import load_function


def step_denominators(batch: TrainBatch, step) -> dict:
    """Trainable tokens and sequences of one optimizer step (`step`: its sample positions), over all data-parallel
    ranks: what a micro-batch's loss is a share of (global means)."""
    return {"tokens": max(1.0, float(sum(batch.loss_masks[i].sum() for i in step))),
            "sequences": max(1, sum(int(batch.loss_masks[i].sum() > 0) for i in step))}


def make_loss_fn(args, batch: TrainBatch, denominators: dict, scale: float, step_index: int, plugin_args=None,
                 keep_log_probs=None, entropy_coef: float | None = None):
    """Return loss_fn(indices, inputs, logits) -> (scaled loss, metrics) for `passes.run_schedule`. A custom loss
    function gets `plugin_args` (the flags and the run's values, `vime.utils.plugin_args`; default `args`).
    `entropy_coef`: this rollout's entropy bonus, where --entropy-coef-schedule moves it (default: --entropy-coef).
    `keep_log_probs` (a `passes.OnHost`, or None) is handed each micro-batch's log-probs, detached, on the device:
    the trainer keeps them for the inspector without a host copy per micro-batch."""
    algorithm = AlgorithmConfig.of(args)
    correction = RolloutCorrectionConfig.of(args)
    rollout_flags = RolloutConfig.of(args)
    distillation = DistillationConfig.of(args)
    policy_loss = get_policy_loss(algorithm.policy_loss)
    # only a built-in loss's own keywords: a loss registered by a user keeps the contract it was written against
    own_kwargs = policy_loss_kwargs(args, step_index)
    custom = load_function(algorithm.custom_loss_function_path) if algorithm.custom_loss_function_path else None
    custom_tis = load_function(correction.custom_tis_function_path) if correction.custom_tis_function_path else None
    top_fraction = algorithm.entropy_top_fraction
    if entropy_coef is None:
        entropy_coef = algorithm.entropy_coef
    mtp_scale = MegatronConfig.of(args).mtp_loss_scaling_factor

    def agg(values, masks):
        return aggregate_loss(values, masks, algorithm.loss_agg_mode, total_tokens=denominators["tokens"],
                              num_sequences=denominators["sequences"],
                              max_response_len=rollout_flags.rollout_max_response_len,
                              num_micro_batches=denominators.get("micro_batches"))

    def token_share(values, masks):  # a fraction of the step's trainable tokens, whatever the aggregation
        return aggregate_loss(values, masks, "token_mean", total_tokens=denominators["tokens"])

    def loss_fn(indices, inputs, logits, mtp=None):
        # entropy is always reported; it needs a graph only when it is part of the loss
        log_probs, entropy = response_log_probs(logits, inputs.targets, inputs.response_lengths,
                                                rollout_flags.rollout_temperature, with_entropy=True,
                                                entropy_grad=bool(entropy_coef) or custom is not None)
        if keep_log_probs is not None:
            keep_log_probs.add(indices, log_probs)
        # the batch lives on the CPU: its tensors go to the model's device once per micro-batch
        mb = batch.select(indices, log_probs[0].device)
        masks = mb["loss_masks"]
        metrics: dict[str, torch.Tensor] = {}

        if custom is not None:
            loss, metrics = custom(plugin_args or args, mb, log_probs, entropy, agg)
        elif algorithm.loss_type == "sft_loss":
            loss = agg([-lp for lp in log_probs], masks)
            metrics["sft_loss"] = loss.detach()
        else:
            old = old_policy_log_probs(args, mb, log_probs)
            rollout = mb.get("rollout_log_probs")
            pg, clipped = policy_loss(log_probs, old, mb["advantages"], masks, eps_clip=algorithm.eps_clip,
                                      eps_clip_high=algorithm.eps_clip_high, eps_clip_c=algorithm.eps_clip_c,
                                      **own_kwargs)
            pg_masks = masks
            if top_fraction is not None:  # only the highest-entropy tokens stay in the policy loss
                keep = top_entropy_mask(entropy, masks, top_fraction)
                pg_masks = [m * k for m, k in zip(masks, keep)]
                metrics["entropy_masked_fraction"] = token_share([1.0 - k for k in keep], masks).detach()
            if custom_tis is not None:  # slime's signature: flat per-token tensors, lists per sample
                flat, keep, tis_metrics = custom_tis(plugin_args or args, pg_loss=torch.cat(pg), train_log_probs=old,
                                                     rollout_log_probs=rollout, loss_masks=masks,
                                                     total_lengths=[len(t) for t in mb["tokens"]],
                                                     response_lengths=[len(m) for m in masks])
                pg = _split_like(flat, pg)
                pg_masks = [m * k.to(m.dtype) for m, k in zip(pg_masks, keep)]
                for name, value in tis_metrics.items():
                    metrics[name] = agg(_split_like(value.detach().float(), pg), masks).detach()
            elif correction.use_tis:
                weights, truncated = truncated_weights(old, rollout, masks, correction.tis_level,
                                                       correction.tis_clip_low, correction.tis_clip)
                pg = [p * w for p, w in zip(pg, weights)]
                metrics["tis_weight_mean"] = agg(weights, masks).detach()
                metrics["tis_clipfrac"] = agg(truncated, masks).detach()
            elif correction.use_mis:  # rejected tokens leave the policy loss; the denominators stay the step's
                weights, keep = compute_mis_weights(old, rollout, masks, correction.mis_level,
                                                    correction.mis_threshold_low, correction.mis_threshold_high)
                pg = [p * w for p, w in zip(pg, weights)]
                pg_masks = [m * k for m, k in zip(pg_masks, keep)]
                metrics["mis_weight_mean"] = agg(weights, masks).detach()
                metrics["mis_masked_fraction"] = agg([1.0 - k for k in keep], masks).detach()
            loss = agg(pg, pg_masks)
            metrics["pg_loss"] = loss.detach()
            metrics["pg_clipfrac"] = agg(clipped, masks).detach()
            metrics["ppo_kl"] = agg([(o - lp).detach() for o, lp in zip(old, log_probs)], masks)
            if entropy_coef:
                loss = loss - entropy_coef * agg(entropy, masks)
            if algorithm.use_kl_loss:
                kl = agg([compute_approx_kl(lp, r, algorithm.kl_loss_type)
                          for lp, r in zip(log_probs, mb["ref_log_probs"])], masks)
                loss = loss + algorithm.kl_loss_coef * kl
                metrics["kl_loss"] = kl.detach()
            if batch.teacher_log_probs is not None:  # on-policy distillation (vime.algorithms.distillation)
                teacher = mb["teacher_log_probs"]
                sampled = sampling_log_probs(mb)
                metrics["opd_reverse_kl"] = agg([s - t for s, t in zip(sampled, teacher)], masks)
                if distillation.opd_mode == "loss":
                    opd = agg([compute_approx_kl(lp, t, distillation.opd_kl_type) for lp, t in zip(log_probs, teacher)],
                              masks)
                    loss = loss + distillation.opd_coef * opd
                    metrics["opd_kl_loss"] = opd.detach()
        metrics["entropy"] = agg([e.detach() for e in entropy], masks)
        metrics["loss"] = loss.detach()  # the policy's
        if mtp is not None:  # the MTP layers' cross-entropy (`mtp_loss.MTPCrossEntropy`), a share of the step's
            mtp_loss = mtp.token_sum(torch.cat(masks)) / denominators["tokens"]  # trainable tokens
            loss = loss + mtp_scale * mtp_loss
            metrics["mtp_loss"] = mtp_loss.detach()
        if step_index == 0:  # parameters still equal the rollout policy's: report the train/inference gap
            metrics.update(rollout_gap(log_probs, mb.get("rollout_log_probs"), masks))
        return loss * scale, metrics

    return loss_fn


def old_policy_log_probs(args, mb: dict, log_probs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The old policy of PPO's ratio: the trainer's log-probs before the rollout's first step (equal to the
    current ones, detached, when the rollout takes one step and they were not computed), or with
    --use-rollout-logprobs the engine's, where the engine scored the sample."""
    correction = RolloutCorrectionConfig.of(args)
    trainer_old = mb.get("old_log_probs") or [lp.detach() for lp in log_probs]
    if not correction.use_rollout_logprobs:
        return trainer_old
    rollout = mb.get("rollout_log_probs") or [None] * len(log_probs)
    return [r if r is not None else o for r, o in zip(rollout, trainer_old)]


def _split_like(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(flat.split([len(t) for t in like]))


def policy_loss_kwargs(args, step_index: int) -> dict:
    """The keywords of the chosen built-in policy loss beyond the shared contract (verl's names for Clip-Cov and
    KL-Cov); Clip-Cov's random pick is seeded by --seed and the step, so a rerun picks the same tokens."""
    algorithm = AlgorithmConfig.of(args)
    job = JobConfig.of(args)
    name = algorithm.policy_loss
    if name == "cispo":
        return {"cispo_eps_low": algorithm.cispo_eps_low}
    if name == "clip_cov":
        return {"clip_cov_ratio": algorithm.clip_cov_ratio, "clip_cov_lb": algorithm.clip_cov_lb,
                "clip_cov_ub": algorithm.clip_cov_ub,
                "generator": torch.Generator().manual_seed(job.seed * 1_000_003 + step_index)}
    if name == "kl_cov":
        return {"kl_cov_ratio": algorithm.kl_cov_ratio, "ppo_kl_coef": algorithm.ppo_kl_coef}
    return {}


def sampling_log_probs(mb: dict) -> list[torch.Tensor]:
    """`TrainBatch.sampling_log_probs` of a selected micro-batch: the engine's, else the trainer's old ones."""
    rollout = mb.get("rollout_log_probs") or [None] * len(mb["loss_masks"])
    return [r if r is not None else mb["old_log_probs"][k] for k, r in enumerate(rollout)]


def rollout_gap(log_probs: list[torch.Tensor], rollout: list | None, masks: list[torch.Tensor]) -> dict:
    """|trainer - engine| log-prob over the trained tokens of the samples the engine scored: sum, count and max,
    as tensors on the log-probs' device (no host sync: masked, not indexed)."""
    pairs = [(lp.detach(), r, m) for lp, r, m in zip(log_probs, rollout or [], masks) if r is not None]
    zero = log_probs[0].new_zeros(())
    if not pairs:
        return {"logprob_diff_sum": zero, "logprob_diff_count": zero, "logprob_diff_max": zero}
    gaps = [torch.where(m.bool(), (lp - r).abs(), 0.0) for lp, r, m in pairs]
    return {"logprob_diff_sum": torch.stack([g.sum() for g in gaps]).sum(),
            "logprob_diff_count": torch.stack([m.sum() for _, _, m in pairs]).sum().to(zero.dtype),
            "logprob_diff_max": torch.stack([g.amax() if g.numel() else zero for g in gaps]).amax()}
