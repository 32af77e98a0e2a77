"""Loss math against hand-computed values (vime/algorithms/losses.py) and flag validation (arguments.py)."""

import argparse
import logging
import math

import pytest
import torch

from vime.algorithms.arguments import add_algorithm_args, validate_algorithm_args
from vime.algorithms.rollout_correction import compute_tis_weights
from vime.algorithms.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    clip_cov_policy_loss,
    compute_approx_kl,
    compute_log_probs_from_logits,
    entropy_from_logits,
    get_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    ppo_policy_loss,
    sft_loss,
    top_entropy_mask,
    value_loss,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def log(x):
    return math.log(x)


# ---------------------------------------------------------------------------------------------- log-probs


def test_log_probs_from_logits_match_manual_log_softmax():
    # Row 0, token 2: 3 - log(e^1 + e^2 + e^3) = 3 - 3.407606 = -0.407606
    # Row 1, token 1 (uniform over 3): -log 3 = -1.098612
    logits = t(1.0, 2.0, 3.0, 0.0, 0.0, 0.0).view(2, 3)
    close(compute_log_probs_from_logits(logits, torch.tensor([2, 1])), [-0.407606, -1.098612])


def test_log_probs_use_temperature_scaled_logits():
    # T = 2: logits / 2 = [0.5, 1, 1.5]; 1.5 - log(e^0.5 + e^1 + e^1.5) = 1.5 - 2.180270 = -0.680270
    logits = t(1.0, 2.0, 3.0).view(1, 3)
    close(compute_log_probs_from_logits(logits, torch.tensor([2]), temperature=2.0), [-0.680270])


def test_log_probs_keep_leading_dims_and_upcast():
    logits = torch.zeros(2, 3, 4, dtype=torch.bfloat16)  # uniform over 4
    out = compute_log_probs_from_logits(logits, torch.zeros(2, 3, dtype=torch.long))
    assert out.shape == (2, 3) and out.dtype == torch.float32
    close(out, torch.full((2, 3), -1.386294))  # -log 4


def test_entropy_from_logits():
    # Uniform over 4: log 4 = 1.386294. probs [0.25, 0.75]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    close(entropy_from_logits(torch.zeros(4)), 1.386294)
    close(entropy_from_logits(t(0.0, log(3.0))), 0.562335)
    # Temperature 0.5 doubles the logits: [0, ln 9] -> probs [0.1, 0.9]: -(0.1 ln 0.1 + 0.9 ln 0.9) = 0.325083
    close(entropy_from_logits(t(0.0, log(3.0)), temperature=0.5), 0.325083)


# ---------------------------------------------------------------------------------------------- KL


def test_kl_estimators_values():
    # Token 0: p = 0.5, ref = 0.25 -> log_ratio = ln 2 = 0.693147, ratio = ref / p = 0.5
    # Token 1: p = 0.25, ref = 0.5 -> log_ratio = -ln 2, ratio = 2
    lp, ref = t(log(0.5), log(0.25)), t(log(0.25), log(0.5))
    close(compute_approx_kl(lp, ref, "k1"), [0.693147, -0.693147])
    # k2 = 0.5 * 0.693147^2 = 0.240227 for both
    close(compute_approx_kl(lp, ref, "k2"), [0.240227, 0.240227])
    # k3 = ratio - 1 - ln(ratio): 0.5 - 1 + 0.693147 = 0.193147; 2 - 1 - 0.693147 = 0.306853
    close(compute_approx_kl(lp, ref, "k3"), [0.193147, 0.306853])
    close(compute_approx_kl(lp, ref, "low_var_kl"), [0.193147, 0.306853])


def test_low_var_kl_is_clamped_and_keeps_gradients_finite():
    # log_ratio -15: k3 = e^15 - 1 - 15 = 3.27e6 -> 10; log_ratio 15: e^-15 - 1 + 15 = 14.0 -> 10
    lp = t(-15.0, 15.0, -200.0).requires_grad_()
    out = compute_approx_kl(lp, torch.zeros(3), "low_var_kl")
    close(out, [10.0, 10.0, 10.0])
    close(compute_approx_kl(t(-15.0, 15.0), torch.zeros(2), "k3"), [math.exp(15) - 16, 14.0], atol=1.0)
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_unknown_kl_type_is_an_error():
    with pytest.raises(ValueError, match="unknown kl_type 'k4'"):
        compute_approx_kl(t(0.0), t(0.0), "k4")


# ---------------------------------------------------------------------------------------------- TIS


def test_tis_weights_are_truncated_at_both_bounds_and_detached():
    # exp(old - rollout) = [3, 0.1, 1.5, 1] -> clamp to [0.5, 2] -> [2, 0.5, 1.5, 1]
    old = t(log(3.0), log(0.1), log(1.5), 0.0).requires_grad_()
    weights = compute_tis_weights(old, torch.zeros(4), tis_clip=2.0, tis_clip_low=0.5)
    close(weights, [2.0, 0.5, 1.5, 1.0])
    assert not weights.requires_grad
    # Default lower bound 0: small weights pass through.
    close(compute_tis_weights(t(log(0.1)), t(0.0)), [0.1])


# ---------------------------------------------------------------------------------------------- policy losses


def ppo_tokens(ratios, advantages, **kw):
    lp = t(*[log(r) for r in ratios])
    loss, clipped = ppo_policy_loss([lp], [torch.zeros(len(ratios))], [t(*advantages)], [torch.ones(len(ratios))], **kw)
    return loss[0], clipped[0]


def test_ppo_clip_positive_and_negative_advantages():
    # A = +1: ratio 1.5 -> max(-1.5, -1.2) = -1.2 (clipped); 0.7 -> max(-0.7, -0.8) = -0.7; 1.1 -> -1.1
    # A = -1: ratio 1.5 -> max(1.5, 1.2) = 1.5; 0.7 -> max(0.7, 0.8) = 0.8 (clipped)
    loss, clipped = ppo_tokens([1.5, 0.7, 1.1, 1.5, 0.7], [1, 1, 1, -1, -1], eps_clip=0.2)
    close(loss, [-1.2, -0.7, -1.1, 1.5, 0.8])
    close(clipped, [1.0, 0.0, 0.0, 0.0, 1.0])


def test_ppo_clip_higher_is_asymmetric():
    # ratio 1.25, A = +1: symmetric 0.2 clips to -1.2; clip-high 0.28 leaves -1.25
    # ratio 0.75, A = -1: the lower bound stays 0.8 either way -> max(0.75, 0.8) = 0.8
    sym, sym_clipped = ppo_tokens([1.25, 0.75], [1, -1], eps_clip=0.2)
    high, high_clipped = ppo_tokens([1.25, 0.75], [1, -1], eps_clip=0.2, eps_clip_high=0.28)
    close(sym, [-1.2, 0.8])
    close(sym_clipped, [1.0, 1.0])
    close(high, [-1.25, 0.8])
    close(high_clipped, [0.0, 1.0])


def test_ppo_dual_clip_caps_negative_advantages_only():
    # eps_clip_c = 3. A = -1, ratio 5: max(5, 1.2) = 5 -> min(5, 3) = 3 (clipped)
    # A = -1, ratio 2: max(2, 1.2) = 2 < 3 -> 2.  A = +1, ratio 5: max(-5, -1.2) = -1.2 (dual clip not applied)
    loss, clipped = ppo_tokens([5.0, 2.0, 5.0], [-1, -1, 1], eps_clip=0.2, eps_clip_c=3.0)
    close(loss, [3.0, 2.0, -1.2])
    close(clipped, [1.0, 0.0, 1.0])
    # Without dual clip the first token's loss would be 5.
    close(ppo_tokens([5.0], [-1], eps_clip=0.2)[0], [5.0])


def test_ppo_gradient_flows_only_through_unclipped_tokens():
    # d(-A * ratio) / d logp = -A * ratio: A = 2, ratio 1.1 -> -2.2; the clipped tokens have gradient 0
    lp = t(log(1.1), log(1.5), log(5.0)).requires_grad_()
    adv = t(2.0, 1.0, -1.0)
    loss, _ = ppo_policy_loss([lp], [torch.zeros(3)], [adv], [torch.ones(3)], eps_clip=0.2, eps_clip_c=3.0)
    loss[0].sum().backward()
    close(lp.grad, [-2.2, 0.0, 0.0])


def test_ppo_returns_ragged_lists():
    loss, clipped = ppo_policy_loss(
        [t(0.0, 0.0), t(0.0)], [t(0.0, 0.0), t(0.0)], [t(1.0, 1.0), t(-2.0)], [t(1, 1), t(1)], eps_clip=0.2
    )
    assert [len(x) for x in loss] == [2, 1] and [len(x) for x in clipped] == [2, 1]
    close(loss[1], [2.0])  # ratio 1: -A * 1


def test_gspo_uses_the_sequence_mean_log_ratio():
    # Seq 0: log ratios [0.2, -0.1, 0.5 (masked)] -> mean over trainable 0.05 -> s = e^0.05 = 1.051271
    #   A = 1, within [0.8, 1.2] -> loss -1.051271 on every token, not clipped
    # Seq 1: log ratios [0.3, 0.5] -> mean 0.4 -> s = e^0.4 = 1.491825 -> clipped to 1.2 -> loss -1.2
    lp0 = t(0.2, -0.1, 0.5).requires_grad_()
    loss, clipped = gspo_policy_loss(
        [lp0, t(0.3, 0.5)],
        [torch.zeros(3), torch.zeros(2)],
        [t(1.0, 1.0, 1.0), t(1.0, 1.0)],
        [t(1, 1, 0), t(1, 1)],
        eps_clip=0.2,
    )
    close(loss[0], [-1.051271] * 3)
    close(loss[1], [-1.2, -1.2])
    close(clipped[0], [0.0] * 3)
    close(clipped[1], [1.0, 1.0])
    # d(-s) / d logp_t = -s / 2 for the two trainable tokens; the masked token gets no gradient
    loss[0][0].backward()
    close(lp0.grad, [-0.525636, -0.525636, 0.0])


def test_gspo_dual_clip_applies_to_the_sequence_ratio():
    # log ratios [ln 4, ln 4] -> s = 4; A = -1, eps_clip_c 3 -> min(max(4, 1.2), 3) = 3
    loss, clipped = gspo_policy_loss(
        [t(log(4.0), log(4.0))], [torch.zeros(2)], [t(-1.0, -1.0)], [t(1, 1)], eps_clip=0.2, eps_clip_c=3.0
    )
    close(loss[0], [3.0, 3.0])
    close(clipped[0], [1.0, 1.0])


def test_policy_loss_registry():
    assert list(POLICY_LOSSES) == ["ppo", "gspo", "cispo", "clip_cov", "kl_cov"]
    assert get_policy_loss("gspo") is gspo_policy_loss
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        get_policy_loss("nope")


# ---------------------------------------------------------------------------------------------- value / sft


def test_value_loss_clips_the_value_update():
    # clip 0.2.
    # v 1.0, old 0.5, R 2.0: (1 - 2)^2 = 1; v_clip 0.7 -> (0.7 - 2)^2 = 1.69 -> 0.5 * 1.69 = 0.845 (clipped)
    # v 0.0, old 0.5, R 0.0: 0; v_clip 0.3 -> 0.09 -> 0.045 (clipped)
    # v 0.6, old 0.5, R 1.0: inside the clip: 0.5 * 0.16 = 0.08
    # v 1.0, old 0.5, R 0.0: 1 vs v_clip 0.7 -> 0.49 -> max 1 -> 0.5 (not clipped)
    v, old, ret = t(1.0, 0.0, 0.6, 1.0), t(0.5, 0.5, 0.5, 0.5), t(2.0, 0.0, 1.0, 0.0)
    loss, clipped = value_loss(v, old, ret, value_clip=0.2)
    close(loss, [0.845, 0.045, 0.08, 0.5])
    close(clipped, [1.0, 1.0, 0.0, 0.0])
    loss, clipped = value_loss(v, old, ret, value_clip=None)
    close(loss, [0.5, 0.0, 0.08, 0.5])  # 0.5 * (v - R)^2
    close(clipped, [0.0] * 4)


def test_sft_loss_is_masked_negative_log_likelihood():
    # token_mean: (1 + 2 + 3) / 3 = 2; seq_mean_token_mean: (1.5 + 3) / 2 = 2.25
    log_probs, masks = [t(-1.0, -2.0), t(-3.0, -100.0)], [t(1, 1), t(1, 0)]
    close(sft_loss(log_probs, masks), 2.0)
    close(sft_loss(log_probs, masks, "seq_mean_token_mean"), 2.25)


# ---------------------------------------------------------------------------------------------- aggregation

LOSSES = [t(1.0, 2.0, 3.0), t(4.0), t(5.0, 6.0), t(7.0, 8.0)]
MASKS = [t(1, 1, 0), t(1), t(1, 1), t(0, 0)]  # the last sequence has no trainable token


def test_aggregation_modes_with_ragged_lengths():
    # Trainable: [1, 2], [4], [5, 6]; the fourth sequence is left out of the sequence count
    close(aggregate_loss(LOSSES, MASKS, "token_mean"), 3.6)  # (1 + 2 + 4 + 5 + 6) / 5 = 18 / 5
    close(aggregate_loss(LOSSES, MASKS, "seq_mean_token_mean"), 11 / 3)  # (1.5 + 4 + 5.5) / 3 = 3.666667
    close(aggregate_loss(LOSSES, MASKS, "seq_mean_token_sum"), 6.0)  # (3 + 4 + 11) / 3


def test_aggregation_with_global_denominators():
    close(aggregate_loss(LOSSES, MASKS, "token_mean", total_tokens=10), 1.8)  # 18 / 10
    close(aggregate_loss(LOSSES, MASKS, "seq_mean_token_sum", num_sequences=6), 3.0)  # 18 / 6
    # Two micro-batches with the global token count sum to the full-batch token mean.
    first = aggregate_loss(LOSSES[:2], MASKS[:2], "token_mean", total_tokens=5)  # (1 + 2 + 4) / 5 = 1.4
    second = aggregate_loss(LOSSES[2:], MASKS[2:], "token_mean", total_tokens=5)  # (5 + 6) / 5 = 2.2
    close(first, 1.4)
    close(first + second, 3.6)


def test_dr_grpo_bnpo_and_dapo_normalisations():
    # Trainable sum 18 over 5 tokens in 3 sequences (LOSSES / MASKS above)
    # seq_mean_token_sum_norm (Dr. GRPO): 18 / (3 sequences * max_response_len 4) = 1.5; global 6 sequences: 0.75
    close(aggregate_loss(LOSSES, MASKS, "seq_mean_token_sum_norm", max_response_len=4), 1.5)
    close(aggregate_loss(LOSSES, MASKS, "seq_mean_token_sum_norm", num_sequences=6, max_response_len=4), 0.75)
    # the constant normaliser: doubling one response's length doubles its share (seq_mean_token_mean would not)
    close(aggregate_loss([t(1.0, 1.0), t(1.0)], [t(1, 1), t(1)], "seq_mean_token_sum_norm", max_response_len=2), 0.75)
    with pytest.raises(ValueError, match="max_response_len"):
        aggregate_loss(LOSSES, MASKS, "seq_mean_token_sum_norm")
    # dapo: the global token mean, 18 / 5 locally, 18 / 10 with the step's 10 tokens
    close(aggregate_loss(LOSSES, MASKS, "dapo"), 3.6)
    close(aggregate_loss(LOSSES, MASKS, "dapo", total_tokens=10), 1.8)
    # bnpo: this micro-batch's own token mean 18 / 5 = 3.6, over 3 micro-batches: 1.2; micro-batches [1, 2, 4] and
    # [5, 6] give (7/3 + 11/2) / 2 = 3.916667, not the global mean 3.6
    close(aggregate_loss(LOSSES, MASKS, "bnpo"), 3.6)
    close(aggregate_loss(LOSSES, MASKS, "bnpo", num_micro_batches=3), 1.2)
    halves = aggregate_loss(LOSSES[:2], MASKS[:2], "bnpo", total_tokens=5, num_micro_batches=2) + \
        aggregate_loss(LOSSES[2:], MASKS[2:], "bnpo", total_tokens=5, num_micro_batches=2)
    close(halves, (7 / 3 + 11 / 2) / 2)


# A = [2, 2, -2, -2], logp = [-1, -3, -1, -3]: centred A = A, centred logp = [1, -1, 1, -1],
# covariance A * logp_c = [2, -2, -2, 2]
COV_ADV = [t(2.0, 2.0, -2.0, -2.0)]
COV_LOGP = [t(-1.0, -3.0, -1.0, -3.0)]
COV_MASK = [t(1, 1, 1, 1)]


def test_clip_cov_cuts_the_gradient_of_high_covariance_tokens():
    # on policy (ratio 1) the loss is -A = [-2, -2, 2, 2]; tokens 0 and 3 (covariance 2 in (1, 5)) are the
    # candidates and ratio 0.5 picks max(1, int(0.5 * 4)) = 2 of them: loss [0, -2, 2, 0]
    logp = [COV_LOGP[0].clone().requires_grad_()]
    loss, clipped = clip_cov_policy_loss(logp, [COV_LOGP[0]], COV_ADV, COV_MASK, eps_clip=0.2, clip_cov_ratio=0.5)
    close(loss[0], [0.0, -2.0, 2.0, 0.0])
    close(clipped[0], [1.0, 0.0, 0.0, 1.0])
    loss[0].sum().backward()
    close(logp[0].grad, [0.0, -2.0, 2.0, 0.0])  # d(-A * ratio)/dlogp = -A on the kept tokens only
    # ratio 0.25: one of the two, drawn by the generator
    loss, clipped = clip_cov_policy_loss(COV_LOGP, COV_LOGP, COV_ADV, COV_MASK, eps_clip=0.2, clip_cov_ratio=0.25,
                                         generator=torch.Generator().manual_seed(0))
    assert clipped[0].tolist() in ([1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0])


def test_clip_cov_leaves_ppo_clipped_tokens_and_the_covariance_bounds_out():
    # token 0's ratio e^0.5 = 1.648721 > 1.2 with A = 2: PPO clips it (loss -2 * 1.2 = -2.4) and it is no candidate,
    # so only token 3 is cut although two may be
    old = [t(-1.5, -3.0, -1.0, -3.0)]
    loss, clipped = clip_cov_policy_loss(COV_LOGP, old, COV_ADV, COV_MASK, eps_clip=0.2, clip_cov_ratio=0.5)
    close(loss[0], [-2.4, -2.0, 2.0, 0.0])
    close(clipped[0], [1.0, 0.0, 0.0, 1.0])
    # covariance 2 outside (2.5, 5): no candidate, the plain PPO loss
    loss, clipped = clip_cov_policy_loss(COV_LOGP, COV_LOGP, COV_ADV, COV_MASK, eps_clip=0.2, clip_cov_ratio=0.5,
                                         clip_cov_lb=2.5)
    close(loss[0], [-2.0, -2.0, 2.0, 2.0])
    close(clipped[0], [0.0, 0.0, 0.0, 0.0])


def test_kl_cov_penalises_the_largest_covariance_tokens():
    # logp [-0.5, -3, -1, -3]: mean -1.875, centred [1.375, -1.125, 0.875, -1.125]; covariance with A = [2, 2, -2,
    # -2]: [2.75, -2.25, -1.75, 2.25]. log_ratio [0.1, 0, 0, -0.1] (old = logp - log_ratio).
    logp = [t(-0.5, -3.0, -1.0, -3.0)]
    old = [t(-0.6, -3.0, -1.0, -2.9)]
    # ratio 0.25 -> 1 token, the largest covariance (token 0): -2 * e^0.1 + 1.0 * 0.1 = -2.110342
    loss, penalised = kl_cov_policy_loss(logp, old, COV_ADV, COV_MASK, kl_cov_ratio=0.25, ppo_kl_coef=1.0)
    close(loss[0], [-2.110342, -2.0, 2.0, 2 * math.exp(-0.1)])
    close(penalised[0], [1.0, 0.0, 0.0, 0.0])
    # ratio 0.5 -> tokens 0 and 3; token 3: 2 * e^-0.1 + 0.5 * 0.1 with ppo_kl_coef 0.5
    loss, penalised = kl_cov_policy_loss(logp, old, COV_ADV, COV_MASK, kl_cov_ratio=0.5, ppo_kl_coef=0.5)
    close(loss[0], [-2 * math.exp(0.1) + 0.05, -2.0, 2.0, 2 * math.exp(-0.1) + 0.05])
    close(penalised[0], [1.0, 0.0, 0.0, 1.0])


def test_top_entropy_mask_keeps_the_highest_entropy_trainable_tokens():
    entropy = [t(0.5, 2.0, 1.0), t(3.0, 9.0)]
    masks = [t(1, 1, 1), t(1, 0)]  # 9.0 is not trainable: never kept, not counted
    # 4 trainable tokens: fraction 0.5 keeps ceil(2) = 2 (3.0 and 2.0), 0.2 keeps ceil(0.8) = 1 (3.0)
    keep = top_entropy_mask(entropy, masks, 0.5)
    close(keep[0], [0.0, 1.0, 0.0])
    close(keep[1], [1.0, 0.0])
    keep = top_entropy_mask(entropy, masks, 0.2)
    close(keep[0], [0.0, 0.0, 0.0])
    close(keep[1], [1.0, 0.0])
    close(top_entropy_mask([t(1.0, 1.0, 1.0)], [t(1, 1, 1)], 0.5)[0], [1.0, 1.0, 0.0])  # ties: the earlier
    close(top_entropy_mask(entropy, masks, 1.0)[0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        top_entropy_mask(entropy, masks, 0.0)


def test_aggregation_ignores_nan_at_masked_positions():
    out = aggregate_loss([t(1.0, float("nan")), t(float("inf"), 3.0)], [t(1, 0), t(0, 1)], "token_mean")
    close(out, 2.0)  # (1 + 3) / 2


def test_aggregation_with_no_trainable_tokens_is_zero_not_nan():
    close(aggregate_loss([t(1.0)], [t(0)], "token_mean"), 0.0)
    close(aggregate_loss([t(1.0)], [t(0)], "seq_mean_token_mean"), 0.0)


def test_aggregation_rejects_unknown_mode_and_mismatched_masks():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'"):
        aggregate_loss(LOSSES, MASKS, "sum")
    with pytest.raises(ValueError, match="loss masks"):
        aggregate_loss(LOSSES, MASKS[:2], "token_mean")


# ---------------------------------------------------------------------------------------------- arguments


def parse(*argv):
    return add_algorithm_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults_and_derived_values():
    args = validate_algorithm_args(parse())
    assert args.advantage_estimator == "grpo" and args.policy_loss == "ppo" and args.loss_agg_mode == "token_mean"
    assert args.eps_clip == 0.2 and args.eps_clip_high == 0.2 and args.eps_clip_c is None
    assert args.kl_loss_type == "k1" and args.tis_clip == 2.0 and args.tis_clip_low == 0.0
    assert args.advantage_eps == 1e-6 and args.use_critic is False
    assert validate_algorithm_args(parse("--eps-clip-high", "0.28")).eps_clip_high == 0.28


def test_every_flag_documents_its_default():
    parser = add_algorithm_args(argparse.ArgumentParser())
    for action in parser._actions:
        if action.dest != "help":
            assert "Default:" in action.help, action.option_strings


def test_ppo_needs_a_critic_and_gspo_needs_its_loss():
    assert validate_algorithm_args(parse("--advantage-estimator", "ppo")).use_critic is True
    args = validate_algorithm_args(parse("--advantage-estimator", "gspo"))
    assert args.policy_loss == "gspo" and args.use_critic is False


def test_bad_dual_clip_is_rejected():
    with pytest.raises(ValueError, match=r"--eps-clip-c must be > 1.0.*got 1.0"):
        validate_algorithm_args(parse("--eps-clip-c", "1.0"))
    assert validate_algorithm_args(parse("--eps-clip-c", "3")).eps_clip_c == 3.0


def test_tis_bounds_must_be_ordered():
    with pytest.raises(ValueError, match=r"--tis-clip-low \(3.0\) must be <= --tis-clip \(2.0\)"):
        validate_algorithm_args(parse("--use-tis", "--tis-clip-low", "3"))


def test_kl_loss_without_coefficient_only_warns(caplog):
    with caplog.at_level(logging.WARNING):
        args = validate_algorithm_args(parse("--use-kl-loss", "--kl-loss-type", "low_var_kl"))
    assert args.use_kl_loss and "--kl-loss-coef is 0.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        validate_algorithm_args(parse("--kl-loss-type", "k3"))  # a type without --use-kl-loss is fine
    assert caplog.text == ""


def test_kl_coef_ignored_by_grpo_warns(caplog):
    with caplog.at_level(logging.WARNING):
        validate_algorithm_args(parse("--kl-coef", "0.1"))
    assert "--kl-coef 0.1 is ignored" in caplog.text


def test_parser_rejects_unknown_choices():
    with pytest.raises(SystemExit):
        parse("--kl-loss-type", "k4")
    with pytest.raises(SystemExit):
        parse("--advantage-estimator", "a2c")


def test_new_estimator_loss_and_shaping_flags_are_checked_with_the_flags_named():
    def check(*argv):
        return validate_algorithm_args(parse(*argv))

    args = check("--policy-loss", "clip_cov", "--clip-cov-ratio", "0.01", "--overlong-buffer-len", "4",
                 "--entropy-coef-schedule", "linear", "--entropy-coef-decay-rollouts", "5", "--entropy-coef", "0.01")
    assert args.policy_loss == "clip_cov" and args.entropy_coef_decay_rollouts == 5
    for argv, message in [
        (("--policy-loss", "clip_cov", "--clip-cov-ratio", "0"), r"--clip-cov-ratio must lie in \(0, 1\]"),
        (("--policy-loss", "kl_cov", "--kl-cov-ratio", "1.5"), r"--kl-cov-ratio must lie in \(0, 1\]"),
        (("--policy-loss", "clip_cov", "--clip-cov-lb", "5", "--clip-cov-ub", "1"), "--clip-cov-lb .* < --clip-cov-ub"),
        (("--policy-loss", "kl_cov", "--eps-clip-c", "3"), "kl_cov has no dual clip; drop --eps-clip-c"),
        (("--policy-loss", "kl_cov", "--advantage-estimator", "gspo"), "--policy-loss kl_cov and --advantage-estimator gspo"),
        (("--overlong-buffer-len", "0"), r"--overlong-buffer-len 0 must lie in \[1"),
        (("--overlong-penalty-factor", "0.5"), "--overlong-penalty-factor needs --overlong-buffer-len"),
        (("--overlong-buffer-len", "4", "--overlong-penalty-factor", "-1"), "--overlong-penalty-factor must be >= 0"),
        (("--entropy-top-fraction", "1.2"), r"--entropy-top-fraction must lie in \(0, 1\]"),
        (("--entropy-coef-schedule", "cosine"), "--entropy-coef-schedule cosine needs --entropy-coef-decay-rollouts"),
    ]:
        with pytest.raises(ValueError, match=message):
            check(*argv)


def test_dr_grpo_agg_without_disabling_std_warns(caplog):
    with caplog.at_level(logging.WARNING):
        validate_algorithm_args(parse("--loss-agg-mode", "seq_mean_token_sum_norm"))
    assert "not Dr. GRPO" in caplog.text
