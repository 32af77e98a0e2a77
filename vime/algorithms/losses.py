"""Loss math: log-probs, KL estimators, policy / value / SFT losses, aggregation (importance weights for the
rollout: `vime.algorithms.rollout_correction`).

Element-wise functions (`compute_approx_kl`, `value_loss`, ...) take tensors of any
shape. Functions that need sequence boundaries (policy losses, `aggregate_loss`, `sft_loss`) take lists of
1-D tensors, one per sample, each of length `response_length`, with 0/1 `loss_masks` of the same shapes.
All losses are to be minimised.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from vime.algorithms.names import KL_TYPES
from vime.config.algorithm import LOSS_AGG_MODES

Tensors = list[torch.Tensor]
PolicyLoss = Callable[..., tuple[Tensors, Tensors]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}


# ----------------------------------------------------------------------------------------------------------
# Log-probs and entropy
# ----------------------------------------------------------------------------------------------------------


def compute_log_probs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) at `tokens`: logits [..., V], tokens [...] -> [...] float32.

    Matches vLLM's `--logprobs-mode processed_logprobs` (log-softmax of temperature-scaled logits) when
    sampling applies no top-k / top-p truncation (vLLM renormalises after it). `logits[..., i, :]` is paired
    with `tokens[..., i]`: the caller shifts (the logits at position t predict token t + 1).
    """
    logits = logits.float() / temperature
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) in nats: [..., V] -> [...] float32."""
    logits = logits.float() / temperature
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


# ----------------------------------------------------------------------------------------------------------
# KL
# ----------------------------------------------------------------------------------------------------------


def compute_approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman, "Approximating KL").

    With log_ratio = log_probs - ref_log_probs and ratio = ref / p = exp(-log_ratio):
      k1 = log_ratio                        unbiased, high variance, can be negative
      k2 = 0.5 * log_ratio^2                biased, low variance
      k3 = ratio - 1 - log(ratio)           unbiased, low variance, >= 0
      low_var_kl = k3 clamped to [-10, 10]  (log_ratio is first clamped to [-20, 20] so exp stays finite
                                             and gradients stay free of inf * 0)
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio**2
    if kl_type == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    if kl_type == "low_var_kl":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_type {kl_type!r}; choose one of {KL_TYPES}")


# ----------------------------------------------------------------------------------------------------------
# Policy losses
# ----------------------------------------------------------------------------------------------------------


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: make `fn` available as `--policy-loss name`.

    Contract: fn(log_probs, old_log_probs, advantages, loss_masks, *, eps_clip, eps_clip_high=None,
    eps_clip_c=None) -> (per_token_loss, clipped), all B x [T_i]; `clipped` is 1.0 where clipping was active.
    (cispo alone also gets `cispo_eps_low`.)
    """

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None,
    eps_clip_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO loss max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high)), element-wise.

    Dual clip (Ye et al. 2020): for A < 0 the loss is further capped at -A * eps_clip_c, so a huge ratio
    on a bad token cannot blow up the update. Returns (loss, clipped) with clipped in {0.0, 1.0}.
    """
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if eps_clip_c is not None:
        cap = -advantages * eps_clip_c
        dual = (advantages < 0) & (cap < loss)
        loss = torch.where(dual, cap, loss)
        is_clipped = is_clipped | dual
    return loss, is_clipped.float()


def _split(x: torch.Tensor, like: Tensors) -> Tensors:
    return list(x.split([len(t) for t in like]))


def _seq_ids(xs: Tensors) -> torch.Tensor:
    """For the concatenation of `xs`, the index of the sequence each element came from. Built on the host from the
    lengths (on a GPU a repeat by device counts would wait for the device) and copied without blocking."""
    ids = torch.repeat_interleave(torch.arange(len(xs)), torch.tensor([len(t) for t in xs], dtype=torch.long))
    return ids.to(xs[0].device, non_blocking=True)


def _seq_sum(flat: torch.Tensor, seq_ids: torch.Tensor, n_seqs: int) -> torch.Tensor:
    return flat.new_zeros(n_seqs).index_add(0, seq_ids, flat)


@register_policy_loss("ppo")
def ppo_policy_loss(
    log_probs: Tensors,
    old_log_probs: Tensors,
    advantages: Tensors,
    loss_masks: Tensors,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """Token-level clipped surrogate with ratio_t = exp(log_probs_t - old_log_probs_t)."""
    ratio = torch.exp(torch.cat(log_probs).float() - torch.cat(old_log_probs).float())
    loss, clipped = _clipped_surrogate(ratio, torch.cat(advantages).float(), eps_clip, eps_clip_high, eps_clip_c)
    return _split(loss, log_probs), _split(clipped, log_probs)


@register_policy_loss("gspo")
def gspo_policy_loss(
    log_probs: Tensors,
    old_log_probs: Tensors,
    advantages: Tensors,
    loss_masks: Tensors,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean over trainable t of (logp - old_logp)).

    s_i is broadcast to the sequence's tokens and clipped like PPO. Gradients flow through the mean, so each
    trainable token of sequence i receives s_i * A / |y_i| (under seq_mean_token_mean aggregation).
    """
    seq_ids = _seq_ids(log_probs)
    mask = torch.cat(loss_masks).bool()
    log_ratio = torch.cat(log_probs).float() - torch.cat(old_log_probs).float()
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    n_tokens = _seq_sum(mask.float(), seq_ids, len(log_probs)).clamp(min=1.0)
    ratio = torch.exp(_seq_sum(log_ratio, seq_ids, len(log_probs)) / n_tokens)[seq_ids]
    loss, clipped = _clipped_surrogate(ratio, torch.cat(advantages).float(), eps_clip, eps_clip_high, eps_clip_c)
    return _split(loss, log_probs), _split(clipped, log_probs)


@register_policy_loss("cispo")
def cispo_policy_loss(
    log_probs: Tensors,
    old_log_probs: Tensors,
    advantages: Tensors,
    loss_masks: Tensors,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    cispo_eps_low: float | None = None,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): loss_t = -sg(clip(r_t, 1 - cispo_eps_low, 1 + eps_clip_high)) * A_t
    * log_probs_t, with r_t = exp(log_probs_t - old_log_probs_t) and sg = stop-gradient.

    The clip bounds the importance weight, not the update: every token keeps the gradient -clip(r_t) * A_t
    w.r.t. its log-prob, where PPO's clipped tokens get none. `cispo_eps_low=None` (the paper's setting) leaves
    the weight unbounded below. `eps_clip` only stands in for a missing `eps_clip_high`; dual clip does not
    apply. `clipped` marks the tokens whose weight was clipped.
    """
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    log_probs_flat = torch.cat(log_probs).float()
    ratio = torch.exp(log_probs_flat - torch.cat(old_log_probs).float()).detach()
    low = None if cispo_eps_low is None else 1.0 - cispo_eps_low
    weight = ratio.clamp(min=low, max=1.0 + eps_clip_high)
    loss = -weight * torch.cat(advantages).float() * log_probs_flat
    return _split(loss, log_probs), _split((weight != ratio).float(), log_probs)


def _covariance(advantages: torch.Tensor, log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token (A_t - mean A) * (logp_t - mean logp), both means over the trainable tokens (Cui et al. 2025's
    centred cross term, whose sum drives the entropy change); detached, NaN-free on masked tokens."""
    a = torch.where(mask, advantages.detach(), torch.zeros_like(advantages))
    lp = torch.where(mask, log_probs.detach(), torch.zeros_like(log_probs))
    n = mask.sum().clamp(min=1)
    return (a - a.sum() / n) * (lp - lp.sum() / n)


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
    log_probs: Tensors,
    old_log_probs: Tensors,
    advantages: Tensors,
    loss_masks: Tensors,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"; verl's `clip_cov`): the PPO
    clipped surrogate, with the gradient of a few high-covariance tokens cut. Among the trainable tokens PPO did not
    clip whose covariance `_covariance` lies in (clip_cov_lb, clip_cov_ub), max(1, int(clip_cov_ratio * trainable
    tokens)) are picked at random (`generator`) and get loss 0 (no gradient). `clipped` marks PPO's clipped tokens
    and the picked ones, as verl's pg_clipfrac does."""
    mask = torch.cat(loss_masks).bool()
    ratio = torch.exp(torch.cat(log_probs).float() - torch.cat(old_log_probs).float())
    adv = torch.cat(advantages).float()
    loss, clipped = _clipped_surrogate(ratio, adv, eps_clip, eps_clip_high, None)
    cov = _covariance(adv, torch.cat(log_probs).float(), mask)
    candidates = ((cov > clip_cov_lb) & (cov < clip_cov_ub) & mask & (clipped == 0)).nonzero().flatten()
    n_pick = max(1, int(clip_cov_ratio * int(mask.sum())))
    picked = candidates[torch.randperm(len(candidates), generator=generator)[:n_pick].to(candidates.device)]
    keep = torch.ones_like(loss)
    keep[picked] = 0.0
    clipped = torch.where(keep == 0, torch.ones_like(clipped), clipped)
    return _split(loss * keep, log_probs), _split(clipped, log_probs)


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
    log_probs: Tensors,
    old_log_probs: Tensors,
    advantages: Tensors,
    loss_masks: Tensors,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """KL-Cov (Cui et al. 2025; verl's `kl_cov`): the unclipped surrogate -A * ratio on every token, plus
    ppo_kl_coef * |logp - old_logp| on the max(1, int(kl_cov_ratio * trainable tokens)) trainable tokens of largest
    covariance (`_covariance`). No ratio clip. `clipped` marks the penalised tokens."""
    mask = torch.cat(loss_masks).bool()
    log_ratio = torch.cat(log_probs).float() - torch.cat(old_log_probs).float()
    adv = torch.cat(advantages).float()
    loss = -adv * torch.exp(log_ratio)
    cov = torch.where(mask, _covariance(adv, torch.cat(log_probs).float(), mask), torch.full_like(adv, -torch.inf))
    n_pick = min(max(1, int(kl_cov_ratio * int(mask.sum()))), int(mask.sum()))
    penalised = torch.zeros_like(loss)
    penalised[torch.topk(cov, n_pick).indices] = 1.0
    loss = loss + penalised * ppo_kl_coef * log_ratio.abs()
    return _split(loss, log_probs), _split(penalised, log_probs)


def top_entropy_mask(entropy: Tensors, loss_masks: Tensors, fraction: float) -> Tensors:
    """1.0 on the ceil(fraction * n) trainable tokens of highest entropy among the n of `entropy` (B x [T_i]), 0.0
    elsewhere: "Beyond the 80/20 Rule" (Wang et al. 2025) trains on the top 20% high-entropy "forking" tokens only.
    Ties at the threshold go to the earlier token. Detached."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the entropy top fraction must lie in (0, 1], got {fraction}")
    mask = torch.cat(loss_masks).bool()
    flat = torch.where(mask, torch.cat(entropy).detach().float(), torch.full_like(mask, -torch.inf, dtype=torch.float32))
    n_keep = math.ceil(fraction * int(mask.sum()))
    keep = torch.zeros_like(flat)
    if n_keep:
        order = torch.sort(flat, descending=True, stable=True).indices  # stable: ties keep the earlier token
        keep[order[:n_keep]] = 1.0
    return _split(keep, entropy)


# ----------------------------------------------------------------------------------------------------------
# Value and SFT losses
# ----------------------------------------------------------------------------------------------------------


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float | None = 0.2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped critic loss 0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped = old + clip(v - old, +-value_clip).

    Element-wise over tensors of one shape; returns (per_token_loss, clipped). `value_clip=None` disables
    clipping: 0.5 * (v - R)^2.
    """
    values, old_values, returns = values.float(), old_values.float(), returns.float()
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def sft_loss(
    log_probs: Tensors,
    loss_masks: Tensors,
    loss_agg_mode: str = "token_mean",
    total_tokens: int | None = None,
    num_sequences: int | None = None,
    **aggregation: Any,
) -> torch.Tensor:
    """Negative log-likelihood of the trainable tokens, aggregated like the policy loss; a scalar."""
    return aggregate_loss([-lp.float() for lp in log_probs], loss_masks, loss_agg_mode, total_tokens, num_sequences,
                          **aggregation)


# ----------------------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------------------


def aggregate_loss(
    per_token_loss: Tensors,
    loss_masks: Tensors,
    mode: str = "token_mean",
    total_tokens: int | None = None,
    num_sequences: int | None = None,
    max_response_len: int | None = None,
    num_micro_batches: int | None = None,
) -> torch.Tensor:
    """Reduce B x [T_i] per-token values to a scalar over trainable tokens (mask 1).

    token_mean:           sum of all trainable tokens' loss / number of trainable tokens
    dapo:                 the same: TRL's `dapo` normalises by the trainable tokens of the whole (global) batch,
                          which is what token_mean does with the step's `total_tokens` (DAPO, Yu et al. 2025)
    bnpo:                 TRL's `bnpo`: sum / trainable tokens of this micro-batch (a local token mean), then
                          averaged over the step's micro-batches: pass `num_micro_batches`, all ranks' together
    seq_mean_token_mean:  per sequence, mean over its trainable tokens; then mean over sequences
    seq_mean_token_sum:   per sequence, sum over its trainable tokens; then mean over sequences
    seq_mean_token_sum_norm: Dr. GRPO (Liu et al. 2025; verl's name, TRL's `dr_grpo`): sum over all trainable
                          tokens / (number of sequences * `max_response_len`), a constant normaliser, so no
                          response is weighted by its own length

    Sequences without trainable tokens are left out of the sequence count. For a global mean across
    micro-batches or data-parallel ranks, pass the global denominator: `total_tokens` (token_mean, dapo) or
    `num_sequences` (seq_* modes); each rank's partial results then sum to the global mean. Masked tokens
    are excluded with `where`, so nan/inf at padded positions does not leak in.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    if len(per_token_loss) != len(loss_masks):
        raise ValueError(f"{len(per_token_loss)} loss sequences but {len(loss_masks)} loss masks")
    if not per_token_loss:
        raise ValueError("aggregate_loss needs at least one sequence")
    loss = torch.cat(per_token_loss).float()
    mask = torch.cat(loss_masks).bool()
    if loss.shape != mask.shape:
        raise ValueError(f"per-token loss has {loss.numel()} tokens but the loss masks have {mask.numel()}")
    loss = torch.where(mask, loss, torch.zeros_like(loss))

    if mode in ("token_mean", "dapo"):
        denominator = total_tokens if total_tokens is not None else mask.sum().clamp(min=1)
        return loss.sum() / denominator
    if mode == "bnpo":
        return loss.sum() / mask.sum().clamp(min=1) / (num_micro_batches or 1)

    seq_ids = _seq_ids(per_token_loss)
    seq_sum = _seq_sum(loss, seq_ids, len(per_token_loss))
    seq_tokens = _seq_sum(mask.float(), seq_ids, len(per_token_loss))
    if mode == "seq_mean_token_mean":
        seq_sum = seq_sum / seq_tokens.clamp(min=1.0)
    denominator = num_sequences if num_sequences is not None else (seq_tokens > 0).sum().clamp(min=1)
    if mode == "seq_mean_token_sum_norm":
        if not max_response_len or max_response_len < 1:
            raise ValueError("seq_mean_token_sum_norm divides by the maximum response length; pass max_response_len")
        denominator = denominator * max_response_len
    return seq_sum.sum() / denominator
