"""Advantage estimators: rewards (and optionally KL, critic values) -> per-token advantages and returns.

Sequences are ragged, so every per-token quantity is a list of 1-D tensors, one per sample, each of length
`response_length`. `loss_masks[i][t]` is 1 for tokens the policy produced and is trained on, 0 for tokens it
did not produce (tool output, environment turns). Masked tokens are not actions: they carry no reward, take
no discount step, do not enter whitening statistics, and get advantage 0.

Every estimator is called the same way, so the trainer has one call site:

    advantages, returns = ADVANTAGE_ESTIMATORS[name](
        rewards=rewards,                  # [B] one scalar reward per sample, group by group
        loss_masks=loss_masks,            # B x [T_i] of 0/1
        n_samples_per_prompt=n,           # group size; B must be a multiple of it
        kl=kl,                            # B x [T_i] per-token KL(policy || reference), or None
        values=values,                    # B x [T_i] critic values (ppo only), or None
        kl_coef=..., gamma=..., lambd=..., normalize_std=..., normalize_advantages=..., eps=...,
    )

A sample whose reward is NaN or inf is treated as one without trainable tokens: advantage 0, no part of any
statistic. Each estimator ignores the keyword arguments it does not use (`**_`); a custom estimator loaded with
`--custom-advantage-function-path` must accept the same keywords. `returns` is the critic's regression
target for ppo; the other estimators have no critic and return `advantages` again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch.nn.utils.rnn import pad_sequence

Tensors = list[torch.Tensor]
AdvantageEstimator = Callable[..., tuple[Tensors, Tensors]]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: make `fn` available as `--advantage-estimator name`."""

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


# ----------------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------------


def _masked_moments(xs: Tensors, loss_masks: Tensors):
    """(flat values, flat mask, mean, population variance) over the batch's masked tokens; None without any."""
    if not loss_masks:
        return None
    flat = torch.cat([x.float() for x in xs])
    mask = torch.cat([m for m in loss_masks]).bool()
    if not mask.any():
        return None
    selected = flat[mask]
    mean = selected.mean()
    return flat, mask, mean, ((selected - mean) ** 2).mean()


def whiten(xs: Tensors, loss_masks: Tensors, eps: float = 1e-6, shift_mean: bool = True) -> Tensors:
    """Normalise B x [T_i] values to zero mean, unit variance over the batch's masked tokens.

    Statistics use only tokens with mask 1 (population variance); masked tokens come back as 0. With
    `shift_mean=False` the mean is added back (scale only).
    """
    moments = _masked_moments(xs, loss_masks)
    if moments is None:
        return [torch.zeros_like(x, dtype=torch.float32) for x in xs]
    flat, mask, mean, var = moments
    out = (flat - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    out = torch.where(mask, out, torch.zeros_like(out))
    return list(out.split([len(x) for x in xs]))


def masked_mean_std(xs: Tensors, loss_masks: Tensors) -> tuple[float, float]:
    """Mean and population std of B x [T_i] values over the batch's masked tokens ((0, 0) with none): the
    statistics `whiten` normalises, reported as train/advantage_mean and train/advantage_std."""
    moments = _masked_moments(xs, loss_masks)
    if moments is None:
        return 0.0, 0.0
    return float(moments[2]), float(moments[3].sqrt())


def _check_lengths(name: str, xs: Sequence[torch.Tensor], loss_masks: Tensors) -> None:
    if len(xs) != len(loss_masks):
        raise ValueError(f"{name}: {len(xs)} sequences but {len(loss_masks)} loss masks")
    for i, (x, m) in enumerate(zip(xs, loss_masks)):
        if x.shape != m.shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(x.shape)} but its loss mask has {tuple(m.shape)}")


def _as_rewards(rewards: torch.Tensor | Sequence[float], loss_masks: Tensors) -> tuple[torch.Tensor, Tensors]:
    """[B] float32 rewards and the loss masks. A sample whose reward is NaN or inf comes back with reward 0 and no
    trainable token: it joins no group's mean or std and no whitening (one would turn them all NaN), and its
    advantage is 0."""
    device = loss_masks[0].device if loss_masks else None
    rewards = torch.as_tensor(rewards, dtype=torch.float32, device=device).flatten()
    if rewards.numel() != len(loss_masks):
        raise ValueError(f"{rewards.numel()} rewards but {len(loss_masks)} loss masks")
    finite = torch.isfinite(rewards)
    if finite.all():
        return rewards, loss_masks
    loss_masks = [m if ok else torch.zeros_like(m) for m, ok in zip(loss_masks, finite.tolist())]
    return torch.where(finite, rewards, torch.zeros_like(rewards)), loss_masks


def _group_view(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """[B] -> [B / n, n]; samples must be ordered group by group."""
    if n_samples_per_prompt < 1 or rewards.numel() % n_samples_per_prompt != 0:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of n_samples_per_prompt={n_samples_per_prompt}"
        )
    return rewards.view(-1, n_samples_per_prompt)


def _group_stats(rewards: torch.Tensor, loss_masks: Tensors, n_samples_per_prompt: int):
    """Per-group mean and unbiased std of the rewards of samples that have trainable tokens.

    A sample with no trainable token (failed, aborted, filtered) is no member of its group's baseline: its
    placeholder reward must not move the others' advantages. Returns ([G, 1] mean, [G, 1] std); a group with
    fewer than two members gets std 0 (its members' advantages are 0 anyway)."""
    groups = _group_view(rewards, n_samples_per_prompt)
    member = torch.stack([m.float().sum() > 0 for m in loss_masks]).view_as(groups).float()
    count = member.sum(dim=-1, keepdim=True)
    mean = (groups * member).sum(dim=-1, keepdim=True) / count.clamp(min=1)
    var = (((groups - mean) ** 2) * member).sum(dim=-1, keepdim=True) / (count - 1).clamp(min=1)
    return groups, mean, var.sqrt()


def _broadcast(per_sample: torch.Tensor, loss_masks: Tensors) -> Tensors:
    """One scalar per sample -> that scalar on each of the sample's trainable tokens (0 on masked ones)."""
    return [a * m.float() for a, m in zip(per_sample, loss_masks)]


def _token_rewards(rewards: torch.Tensor, loss_masks: Tensors, kl: Tensors | None, kl_coef: float) -> Tensors:
    """Per-token rewards: -kl_coef * kl_t on every trainable token, plus the sample's reward on its last one."""
    if kl_coef != 0.0 and kl is None:
        raise ValueError("kl_coef != 0 needs per-token kl (reference log-probs); pass kl= or set --kl-coef 0")
    out = []
    for i, mask in enumerate(loss_masks):
        mask = mask.float()
        r = -kl_coef * kl[i].detach().float() * mask if kl is not None else torch.zeros_like(mask)
        trainable = mask.nonzero().flatten()
        if len(trainable) > 0:
            r[trainable[-1]] += rewards[i]
        out.append(r)
    return out


def _discounted_sum(xs: Tensors, loss_masks: Tensors, discount: float) -> Tensors:
    """y_t = x_t + discount * y_next, where `next` is the next trainable token; y = 0 on masked tokens.

    Masked tokens are squeezed out first, so tool output in the middle of a response neither adds to the
    sum nor costs a discount step.
    """
    idx = [m.bool().nonzero().flatten() for m in loss_masks]
    packed = pad_sequence([x.float()[i] for x, i in zip(xs, idx)], batch_first=True)  # [B, T_max], 0-padded
    if discount == 1.0:
        ys = packed.flip(-1).cumsum(-1).flip(-1)
    else:
        ys = torch.zeros_like(packed)
        running = packed.new_zeros(packed.shape[0])
        for t in reversed(range(packed.shape[1])):
            running = packed[:, t] + discount * running
            ys[:, t] = running
    out = []
    for x, i, y in zip(xs, idx, ys):
        full = y.new_zeros(len(x))
        full[i] = y[: len(i)]
        out.append(full)
    return out


# ----------------------------------------------------------------------------------------------------------
# Estimators
# ----------------------------------------------------------------------------------------------------------


@register_advantage_estimator("grpo")
def grpo_advantages(
    rewards: torch.Tensor | Sequence[float],
    loss_masks: Tensors,
    *,
    n_samples_per_prompt: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """A_i = (r_i - mean(group)) / (std(group) + eps) on every trainable token of sample i.

    `std` is the unbiased sample std of the group; samples without trainable tokens (or without a finite reward)
    are left out of both. `normalize_std=False` drops the division (Dr. GRPO), leaving r_i - mean(group). Groups
    need at least two samples: with one, every advantage would be 0.
    """
    rewards, loss_masks = _as_rewards(rewards, loss_masks)
    if n_samples_per_prompt < 2:
        raise ValueError("grpo/gspo/cispo compare samples within a group; set --n-samples-per-prompt >= 2")
    groups, mean, std = _group_stats(rewards, loss_masks, n_samples_per_prompt)
    centred = groups - mean
    if normalize_std:
        centred = centred / (std + eps)
    advantages = _broadcast(centred.flatten(), loss_masks)
    return advantages, advantages


@register_advantage_estimator("gspo")
def gspo_advantages(
    rewards: torch.Tensor | Sequence[float], loss_masks: Tensors, **kwargs: Any
) -> tuple[Tensors, Tensors]:
    """Same sequence-level advantages as grpo; GSPO differs in its loss (a sequence-level ratio)."""
    return grpo_advantages(rewards, loss_masks, **kwargs)


@register_advantage_estimator("cispo")
def cispo_advantages(
    rewards: torch.Tensor | Sequence[float], loss_masks: Tensors, **kwargs: Any
) -> tuple[Tensors, Tensors]:
    """Same group-normalised advantages as grpo; CISPO differs in its loss (a clipped, detached IS weight)."""
    return grpo_advantages(rewards, loss_masks, **kwargs)


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    rewards: torch.Tensor | Sequence[float],
    loss_masks: Tensors,
    *,
    kl: Tensors | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-6,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """Discounted return G_t = sum_{k>=t} gamma^(k-t) r_k over trainable tokens, whitened across the batch.

    r_k = -kl_coef * kl_k, plus the sample's reward on its last trainable token.
    """
    rewards, loss_masks = _as_rewards(rewards, loss_masks)
    if kl is not None:
        _check_lengths("kl", kl, loss_masks)
    returns = _discounted_sum(_token_rewards(rewards, loss_masks, kl, kl_coef), loss_masks, gamma)
    advantages = whiten(returns, loss_masks, eps=eps)
    return advantages, advantages


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor | Sequence[float],
    loss_masks: Tensors,
    *,
    n_samples_per_prompt: int,
    eps: float = 1e-6,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """A = whiten(r_i - mean(group)) with r_i - mean(group) on each trainable token of sample i."""
    rewards, loss_masks = _as_rewards(rewards, loss_masks)
    groups, mean, _ = _group_stats(rewards, loss_masks, n_samples_per_prompt)
    centred = (groups - mean).flatten()
    advantages = whiten(_broadcast(centred, loss_masks), loss_masks, eps=eps)
    return advantages, advantages


@register_advantage_estimator("ppo")
def gae_advantages(
    rewards: torch.Tensor | Sequence[float],
    loss_masks: Tensors,
    *,
    values: Tensors | None = None,
    kl: Tensors | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
    normalize_advantages: bool = False,
    eps: float = 1e-6,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """Generalised advantage estimation over trainable tokens t = 0..T-1 (V_T = 0):

        delta_t = r_t + gamma * V_{t+1} - V_t;   A_t = delta_t + gamma * lambd * A_{t+1};   R_t = A_t + V_t

    r_t = -kl_coef * kl_t, plus the reward on the last trainable token. Returns (advantages, returns);
    `returns` is computed before the optional whitening of advantages. Both are 0 on masked tokens.
    """
    rewards, loss_masks = _as_rewards(rewards, loss_masks)
    if values is None:
        raise ValueError("the ppo advantage estimator needs critic values (values=...)")
    _check_lengths("values", values, loss_masks)
    if kl is not None:
        _check_lengths("kl", kl, loss_masks)
    token_rewards = _token_rewards(rewards, loss_masks, kl, kl_coef)

    deltas = []
    for r, v, m in zip(token_rewards, values, loss_masks):
        idx = m.bool().nonzero().flatten()
        v_trainable = v.detach().float()[idx]
        v_next = torch.cat([v_trainable[1:], v_trainable.new_zeros(1)])
        delta = r.new_zeros(len(m))
        delta[idx] = r[idx] + gamma * v_next - v_trainable
        deltas.append(delta)

    advantages = _discounted_sum(deltas, loss_masks, gamma * lambd)
    returns = [a + v.detach().float() * m.float() for a, v, m in zip(advantages, values, loss_masks)]
    if normalize_advantages:
        advantages = whiten(advantages, loss_masks, eps=eps)
    return advantages, returns


@register_advantage_estimator("rloo")
def rloo_advantages(
    rewards: torch.Tensor | Sequence[float],
    loss_masks: Tensors,
    *,
    n_samples_per_prompt: int,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"; TRL's and OpenRLHF's `rloo`, verl's `rloo`): each sample's
    baseline is the mean reward of the *other* members of its group, A_i = r_i - (sum_j r_j - r_i) / (k - 1),
    k the number of members (samples with trainable tokens and a finite reward). No std normalisation. A group
    with fewer than two members gives its member advantage 0 (there is no other sample to compare with)."""
    rewards, loss_masks = _as_rewards(rewards, loss_masks)
    if n_samples_per_prompt < 2:
        raise ValueError("rloo's baseline is the other samples of the group; set --n-samples-per-prompt >= 2")
    groups = _group_view(rewards, n_samples_per_prompt)
    member = torch.stack([m.float().sum() > 0 for m in loss_masks]).view_as(groups).float()
    count = member.sum(dim=-1, keepdim=True)
    others_mean = ((groups * member).sum(dim=-1, keepdim=True) - groups) / (count - 1).clamp(min=1)
    advantages = torch.where(count > 1, groups - others_mean, torch.zeros_like(groups)) * member
    advantages = _broadcast(advantages.flatten(), loss_masks)
    return advantages, advantages


@register_advantage_estimator("remax")
def remax_advantages(
    rewards: torch.Tensor | Sequence[float],
    loss_masks: Tensors,
    *,
    greedy_rewards: torch.Tensor | Sequence[float] | None = None,
    **_: Any,
) -> tuple[Tensors, Tensors]:
    """ReMax (Li et al. 2024, verl's `remax`): A_i = r_i - r_greedy, the baseline being the reward of a greedy
    (temperature 0) response to the same prompt. `greedy_rewards` holds it per sample ([B]; the rollout puts the
    group's into each sample's metadata, `names.REMAX_GREEDY_REWARD_KEY`). No normalisation. A sample whose greedy
    reward is NaN has no baseline and gets advantage 0."""
    rewards, loss_masks = _as_rewards(rewards, loss_masks)
    if greedy_rewards is None:
        raise ValueError("remax needs each sample's greedy baseline reward (greedy_rewards=...); the default rollout "
                         "writes it with --advantage-estimator remax")
    baseline = torch.as_tensor(greedy_rewards, dtype=torch.float32, device=rewards.device).flatten()
    if baseline.numel() != rewards.numel():
        raise ValueError(f"{baseline.numel()} greedy rewards but {rewards.numel()} rewards")
    has_baseline = torch.isfinite(baseline)
    advantages = torch.where(has_baseline, rewards - torch.nan_to_num(baseline), torch.zeros_like(rewards))
    advantages = _broadcast(advantages, loss_masks)
    return advantages, advantages
