"""Rollout correction: importance weights for tokens the engine sampled under another policy than the one the
trainer's loss takes as old (kernels and precision differ; in asynchronous training the weights differ too).

With the old policy pi_old (the trainer's log-probs before the step, the *proximal* policy of AReaL's decoupled
objective) and the behaviour policy pi_b (the engine's log-probs, `rollout_log_probs`), the policy loss of each
token is multiplied by a weight w = pi_old / pi_b taken at one of three levels:
  token:     w_t = exp(old_t - b_t)
  sequence:  w = exp(sum over the sequence's trainable tokens of (old_t - b_t)): the likelihood ratio of the
             whole response; the sum is clamped to [-20, 20] before exp
  geometric: w = exp(mean over the sequence's trainable tokens of (old_t - b_t)): its per-token geometric mean,
             comparable across lengths
and one of two modes:
  truncate (TIS):  w clamped to [low, high]; every token keeps a gradient
  mask (MIS):      w kept where it lies in [low, high]; the token (or sequence) leaves the loss where it does not.
                   At token level this is ICE-POP (IcePop: tokens whose train / inference ratio leaves [alpha, beta]
                   get no gradient, the rest keep the ratio).
PPO's clip on pi / pi_old times the truncated w is AReaL's decoupled objective; `--use-rollout-logprobs` instead
takes pi_b as the old policy ("bypass": no correction, no old-log-prob forward pass).

Tokens with mask 0 (tool output, whose engine log-probs are placeholders) enter no sum and are never rejected.
All functions take lists of 1-D tensors, one per sample, and return detached tensors of the same shapes.
"""

from __future__ import annotations

import torch

from vime.algorithms.losses import _seq_ids, _seq_sum, _split
from vime.algorithms.names import CORRECTION_LEVELS

Tensors = list[torch.Tensor]


def compute_tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, tis_clip: float = 2.0, tis_clip_low: float = 0.0
) -> torch.Tensor:
    """Token-level truncated importance weights exp(old - rollout) clamped to [tis_clip_low, tis_clip], detached;
    tensors of any shape."""
    weights = torch.exp(old_log_probs.float() - rollout_log_probs.float())
    return weights.clamp(min=tis_clip_low, max=tis_clip).detach()


def correction_log_ratios(old_log_probs: Tensors, rollout_log_probs: Tensors, loss_masks: Tensors,
                          level: str = "token") -> torch.Tensor:
    """log w of every token (concatenated over the samples) at `level`; 0 on tokens with mask 0 at token level."""
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown correction level {level!r}; choose one of {CORRECTION_LEVELS}")
    mask = torch.cat(loss_masks).bool()
    log_ratio = torch.cat(old_log_probs).float() - torch.cat(rollout_log_probs).float()
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).detach()
    if level == "token":
        return log_ratio
    seq_ids = _seq_ids(old_log_probs)
    per_seq = _seq_sum(log_ratio, seq_ids, len(old_log_probs))
    if level == "geometric":
        per_seq = per_seq / _seq_sum(mask.float(), seq_ids, len(old_log_probs)).clamp(min=1.0)
    return per_seq.clamp(-20.0, 20.0)[seq_ids]


def truncated_weights(old_log_probs: Tensors, rollout_log_probs: Tensors, loss_masks: Tensors,
                      level: str = "token", low: float = 0.0, high: float = 2.0) -> tuple[Tensors, Tensors]:
    """TIS at `level`: (weights clamped to [low, high], truncated: 1.0 where the clamp changed the weight)."""
    raw = torch.exp(correction_log_ratios(old_log_probs, rollout_log_probs, loss_masks, level))
    weights = raw.clamp(min=low, max=high)
    return _split(weights, old_log_probs), _split((weights != raw).float(), old_log_probs)


def compute_mis_weights(old_log_probs: Tensors, rollout_log_probs: Tensors, loss_masks: Tensors,
                        level: str = "token", low: float = 0.5, high: float = 2.0) -> tuple[Tensors, Tensors]:
    """MIS at `level`: (weights, keep). keep is 1.0 for tokens whose weight lies in [low, high] (and for tokens
    with mask 0), 0.0 for rejected ones; weights is w where kept, 0 elsewhere."""
    mask = torch.cat(loss_masks).bool()
    weights = torch.exp(correction_log_ratios(old_log_probs, rollout_log_probs, loss_masks, level))
    keep = ((weights >= low) & (weights <= high)) | ~mask
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    return _split(weights, old_log_probs), _split(keep.float(), old_log_probs)
