"""CISPO loss and masked importance sampling against hand-computed values (vime/algorithms/losses.py), and their
flags (vime/algorithms/arguments.py)."""

import argparse
import math

import pytest
import torch

from vime.algorithms.advantages import ADVANTAGE_ESTIMATORS
from vime.algorithms.arguments import add_algorithm_args, validate_algorithm_args
from vime.algorithms.rollout_correction import compute_mis_weights
from vime.algorithms.losses import (
    aggregate_loss,
    cispo_policy_loss,
    get_policy_loss,
    ppo_policy_loss,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


L = math.log

# ---------------------------------------------------------------------------------------------- CISPO

# Three tokens, eps_clip 0.2 (upper weight bound 1.2):
#   a: logp log 0.5, old log 0.25 -> r 2.0, clipped to 1.2; A +1
#   b: logp log 0.5, old log 0.5  -> r 1.0;                  A +1
#   c: logp log 0.25, old log 0.5 -> r 0.5 (no lower bound);  A -2
LOGP, OLD, ADV, MASK = [L(0.5), L(0.5), L(0.25)], [t(L(0.25), L(0.5), L(0.5))], [t(1.0, 1.0, -2.0)], [t(1, 1, 1)]


def test_cispo_loss_and_gradient_by_hand():
    log_probs = t(*LOGP).requires_grad_()
    loss, clipped = cispo_policy_loss([log_probs], OLD, ADV, MASK, eps_clip=0.2)
    # loss_t = -w_t * A_t * logp_t:  a: -1.2 * 1 * (-0.693147) = 0.831777;  b: 0.693147;
    #                                c: -0.5 * (-2) * (-1.386294) = -1.386294
    close(loss[0], [0.831777, 0.693147, -1.386294])
    close(clipped[0], [1.0, 0.0, 0.0])
    # token mean (0.831777 + 0.693147 - 1.386294) / 3 = 0.138629 / 3 = 0.046210
    total = aggregate_loss(loss, MASK, "token_mean")
    close(total, 0.046210)
    total.backward()
    # d/dlogp_t = -w_t * A_t / 3 (the weight is detached): a: -1.2 / 3 = -0.4, b: -1 / 3, c: 1.0 / 3
    close(log_probs.grad, [-0.4, -0.333333, 0.333333])


def test_cispo_keeps_the_gradient_ppo_drops_on_a_clipped_token():
    cispo_lp = t(*LOGP).requires_grad_()
    loss, _ = cispo_policy_loss([cispo_lp], OLD, ADV, MASK, eps_clip=0.2)
    loss[0].sum().backward()
    ppo_lp = t(*LOGP).requires_grad_()
    loss, clipped = ppo_policy_loss([ppo_lp], OLD, ADV, MASK, eps_clip=0.2)
    loss[0].sum().backward()
    # token a (r 2 > 1.2, A > 0): CISPO's gradient is -clip(r) * A = -1.2; PPO's loss is the constant -1.2 * A: 0
    close(cispo_lp.grad[0], -1.2)
    close(ppo_lp.grad[0], 0.0)
    close(clipped[0][0], 1.0)


def test_cispo_lower_bound_and_eps_clip_high():
    log_probs = t(*LOGP).requires_grad_()
    loss, clipped = cispo_policy_loss([log_probs], OLD, ADV, MASK, eps_clip=0.2, eps_clip_high=2.0,
                                      cispo_eps_low=0.2, eps_clip_c=3.0)  # dual clip is ignored
    # a: r 2.0 inside [0.8, 3.0] -> 2 * 0.693147 = 1.386294;  b: 0.693147;  c: r 0.5 -> 0.8: 0.8 * 2 * -1.386294
    close(loss[0], [1.386294, 0.693147, -2.218071])
    close(clipped[0], [0.0, 0.0, 1.0])
    loss[0].sum().backward()
    close(log_probs.grad, [-2.0, -1.0, 1.6])  # -w * A


def test_cispo_is_registered_for_the_estimator_and_the_loss():
    assert get_policy_loss("cispo") is cispo_policy_loss
    adv, _ = ADVANTAGE_ESTIMATORS["cispo"](rewards=[1.0, 0.0], loss_masks=[t(1, 1), t(1)], n_samples_per_prompt=2)
    close(adv[0], [0.707106, 0.707106])  # grpo: (1 - 0.5) / std 0.707107, as for gspo
    close(adv[1], [-0.707106])


# ---------------------------------------------------------------------------------------------- MIS

# seq 0, old / rollout probabilities: 0.5 / 0.2 (w 2.5), 0.4 / 0.5 (w 0.8), 0.3 / 0.25 (w 1.2)
# seq 1: 0.6 / 0.4 (w 1.5), 0.1 / 0.25 (w 0.4), then a tool token (mask 0) with placeholder engine log-prob 0
MIS_OLD = [t(L(0.5), L(0.4), L(0.3)), t(L(0.6), L(0.1), L(0.01))]
MIS_ROLLOUT = [t(L(0.2), L(0.5), L(0.25)), t(L(0.4), L(0.25), 0.0)]
MIS_MASKS = [t(1, 1, 1), t(1, 1, 0)]


def test_mis_token_level_keeps_inliers_with_their_weight_and_zeroes_outliers():
    weights, keep = compute_mis_weights(MIS_OLD, MIS_ROLLOUT, MIS_MASKS, "token", 0.5, 2.0)
    # 2.5 and 0.4 lie outside [0.5, 2]; the tool token enters nothing: weight exp(0) = 1, kept
    close(weights[0], [0.0, 0.8, 1.2])
    close(keep[0], [0.0, 1.0, 1.0])
    close(weights[1], [1.5, 0.0, 1.0])
    close(keep[1], [1.0, 0.0, 1.0])


def test_mis_sequence_level_decides_on_the_product_of_the_trainable_tokens_ratios():
    weights, keep = compute_mis_weights(MIS_OLD, MIS_ROLLOUT, MIS_MASKS, "sequence", 0.5, 2.0)
    # seq 0: 2.5 * 0.8 * 1.2 = 2.4 > 2 -> rejected (its geometric mean 1.34 would have been kept)
    close(weights[0], [0.0, 0.0, 0.0])
    close(keep[0], [0.0, 0.0, 0.0])
    # seq 1: 1.5 * 0.4 = 0.6 (the tool token's 0.01 / 1 is left out, or the sequence would be rejected)
    close(weights[1], [0.6, 0.6, 0.6])
    close(keep[1], [1.0, 1.0, 1.0])


def test_mis_sequence_level_survives_huge_log_ratios_and_rejects_unknown_levels():
    weights, keep = compute_mis_weights([t(0.0).repeat(100)], [t(-5.0).repeat(100)], [torch.ones(100)], "sequence")
    assert torch.isfinite(weights[0]).all()  # sum 500 is clamped to 20 before exp
    close(keep[0], torch.zeros(100))
    with pytest.raises(ValueError, match="unknown correction level 'harmonic'"):
        compute_mis_weights(MIS_OLD, MIS_ROLLOUT, MIS_MASKS, "harmonic")


# ---------------------------------------------------------------------------------------------- flags


def parse(*argv):
    return validate_algorithm_args(add_algorithm_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_defaults():
    args = parse()
    assert args.cispo_eps_low is None and args.use_mis is False and args.mis_level == "token"
    assert (args.mis_threshold_low, args.mis_threshold_high) == (0.5, 2.0)


def test_cispo_estimator_selects_the_cispo_loss():
    args = parse("--advantage-estimator", "cispo", "--cispo-eps-low", "0.9")
    assert args.policy_loss == "cispo" and args.use_critic is False and args.cispo_eps_low == 0.9
    assert parse("--policy-loss", "cispo").policy_loss == "cispo"  # with any estimator, too
    with pytest.raises(ValueError, match="--cispo-eps-low must be > 0, got 0.0"):
        parse("--advantage-estimator", "cispo", "--cispo-eps-low", "0")


def test_mis_and_tis_are_mutually_exclusive():
    with pytest.raises(ValueError, match="--use-mis and --use-tis are mutually exclusive"):
        parse("--use-mis", "--use-tis")
    assert parse("--use-mis", "--mis-level", "sequence").mis_level == "sequence"


@pytest.mark.parametrize("low, high", [("2", "2"), ("3", "2"), ("-0.1", "2")])
def test_mis_thresholds_must_be_ordered(low, high):
    with pytest.raises(ValueError, match=r"MIS thresholds must satisfy 0 <= --mis-threshold-low"):
        parse("--use-mis", "--mis-threshold-low", low, "--mis-threshold-high", high)


def test_unknown_mis_level_is_refused_at_parse():
    with pytest.raises(SystemExit):
        parse("--mis-level", "harmonic")
