"""Advantage estimators against hand-computed values (vime/algorithms/advantages.py)."""

import pytest
import torch

from vime.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
    register_advantage_estimator,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    whiten,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def assert_close(actual, expected, atol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, torch.as_tensor(e, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- grpo / gspo


def test_grpo_normalises_per_group_and_masks_tokens():
    # Group 1 rewards [1, 0, 0]: mean 1/3; deviations 2/3, -1/3, -1/3;
    #   unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3, std = 0.577350
    #   A = 0.666667 / 0.577350 = 1.154700, -0.333333 / 0.577350 = -0.577350
    # Group 2 rewards [2, 2, 2]: std 0 -> A = 0 / (0 + eps) = 0
    rewards = [1.0, 0.0, 0.0, 2.0, 2.0, 2.0]
    masks = [t(1, 0, 1), t(1), t(1, 1), t(1), t(1, 1), t(0, 1)]
    adv, ret = grpo_advantages(rewards, masks, n_samples_per_prompt=3)
    assert_close(
        adv,
        [[1.154700, 0.0, 1.154700], [-0.577350], [-0.577350, -0.577350], [0.0], [0.0, 0.0], [0.0, 0.0]],
    )
    assert ret is adv


def test_grpo_without_std_is_dr_grpo():
    # rewards [1, 0, 0] - mean 1/3 = [2/3, -1/3, -1/3], no division
    adv, _ = grpo_advantages([1.0, 0.0, 0.0], [t(1, 1), t(1), t(1)], n_samples_per_prompt=3, normalize_std=False)
    assert_close(adv, [[0.666667, 0.666667], [-0.333333], [-0.333333]])


def test_grpo_is_zero_mean_within_each_group():
    torch.manual_seed(0)
    rewards = torch.rand(12)
    masks = [torch.ones(1) for _ in range(12)]
    for normalize_std in (True, False):
        adv, _ = grpo_advantages(rewards, masks, n_samples_per_prompt=4, normalize_std=normalize_std)
        per_sample = torch.cat(adv).view(3, 4)
        torch.testing.assert_close(per_sample.sum(dim=1), torch.zeros(3), atol=1e-5, rtol=0)
        assert per_sample.abs().sum() > 0


def test_grpo_rejects_bad_group_sizes():
    with pytest.raises(ValueError, match="n-samples-per-prompt"):
        grpo_advantages([1.0, 0.0], [t(1), t(1)], n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=2"):
        grpo_advantages([1.0, 0.0, 1.0], [t(1), t(1), t(1)], n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="2 rewards but 3 loss masks"):
        grpo_advantages([1.0, 0.0], [t(1), t(1), t(1)], n_samples_per_prompt=2)


def test_gspo_estimator_gives_grpo_advantages():
    # rewards [1, 0]: mean 0.5, unbiased std = sqrt((0.25 + 0.25) / 1) = 0.707107; A = +-0.5 / 0.707107
    adv, _ = ADVANTAGE_ESTIMATORS["gspo"](rewards=[1.0, 0.0], loss_masks=[t(1, 1), t(1)], n_samples_per_prompt=2)
    assert_close(adv, [[0.707106, 0.707106], [-0.707106]])


# ---------------------------------------------------------------------------------------------- reinforce++


def test_reinforce_plus_plus_discounts_kl_penalised_returns_then_whitens():
    # kl_coef 0.5, gamma 0.5.
    # Sample A (reward 1, kl [0.1, 0.2, 0.3]): r = [-0.05, -0.1, -0.15 + 1] = [-0.05, -0.1, 0.85]
    #   G2 = 0.85; G1 = -0.1 + 0.5 * 0.85 = 0.325; G0 = -0.05 + 0.5 * 0.325 = 0.1125
    # Sample B (reward 0, kl [0.2, 9.0], mask [1, 0]): reward sits on the last trainable token (index 0);
    #   r = [-0.1]; G0 = -0.1; the masked token's kl of 9.0 is not a reward.
    # Whitening over [0.1125, 0.325, 0.85, -0.1]: mean 0.296875, population var 0.124561
    #   -> (G - 0.296875) / sqrt(0.124561 + 1e-6)
    adv, ret = reinforce_plus_plus_advantages(
        [1.0, 0.0],
        [t(1, 1, 1), t(1, 0)],
        kl=[t(0.1, 0.2, 0.3), t(0.2, 9.0)],
        kl_coef=0.5,
        gamma=0.5,
    )
    assert_close(adv, [[-0.522408, 0.079689, 1.567225], [-1.124506, 0.0]])
    assert ret is adv


def test_reinforce_plus_plus_skips_masked_tokens_when_discounting():
    # A masked tool token in the middle takes no discount step: trainable r = [0, 1], gamma 0.5
    #   -> G = [0.5, 1] (not [0.25, ., 1]); whitened: mean 0.75, var 0.0625, std 0.25 -> [-1, 1]
    adv, _ = reinforce_plus_plus_advantages([1.0], [t(1, 0, 1)], gamma=0.5)
    assert_close(adv, [[-1.0, 0.0, 1.0]], atol=1e-4)


def test_reward_sits_on_the_last_trainable_token():
    # Response ends with a masked tool token: the reward goes on token 1, not on the masked token 2.
    #   reinforce++, gamma 0.5: r = [0, 1] -> G = [0.5, 1] -> whitened [-1, 1]
    adv, _ = reinforce_plus_plus_advantages([1.0], [t(1, 1, 0)], gamma=0.5)
    assert_close(adv, [[-1.0, 1.0, 0.0]], atol=1e-4)
    #   GAE, gamma = lambd = 1, V = 0: A = [1, 1, 0]
    adv, _ = gae_advantages([1.0], [t(1, 1, 0)], values=[torch.zeros(3)])
    assert_close(adv, [[1.0, 1.0, 0.0]])


def test_kl_coef_without_kl_is_an_error():
    with pytest.raises(ValueError, match="kl_coef"):
        reinforce_plus_plus_advantages([1.0], [t(1, 1)], kl_coef=0.1)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    # n = 2, rewards [1, 0 | 0.5, 0.5] -> centred [0.5, -0.5 | 0, 0]
    # Trainable tokens: 0.5, 0.5 (A), -0.5 (B), 0 (C, second token masked), 0 (D)
    #   mean 0.1; deviations 0.4, 0.4, -0.6, -0.1, -0.1; var = (0.16+0.16+0.36+0.01+0.01) / 5 = 0.14
    #   std = 0.374166 -> 1.069041, -1.603562, -0.267260
    adv, _ = reinforce_plus_plus_baseline_advantages(
        [1.0, 0.0, 0.5, 0.5], [t(1, 1), t(1), t(1, 0), t(1)], n_samples_per_prompt=2
    )
    assert_close(adv, [[1.069041, 1.069041], [-1.603562], [-0.267260, 0.0], [-0.267260]])


# ---------------------------------------------------------------------------------------------- ppo (GAE)


def test_gae_matches_hand_computation_for_three_tokens():
    # gamma 0.9, lambd 0.8, V = [0.5, 0.4, 0.3], V_3 = 0, kl = [0.1, 0, 0.2], kl_coef 0.5, reward 1
    #   r = [-0.05, 0, -0.1 + 1] = [-0.05, 0, 0.9]
    #   delta2 = 0.9 + 0.9 * 0 - 0.3 = 0.6
    #   delta1 = 0 + 0.9 * 0.3 - 0.4 = -0.13
    #   delta0 = -0.05 + 0.9 * 0.4 - 0.5 = -0.19
    #   A2 = 0.6; A1 = -0.13 + 0.72 * 0.6 = 0.302; A0 = -0.19 + 0.72 * 0.302 = 0.02744
    #   R = A + V = [0.52744, 0.702, 0.9]
    adv, ret = gae_advantages(
        [1.0], [t(1, 1, 1)], values=[t(0.5, 0.4, 0.3)], kl=[t(0.1, 0.0, 0.2)], kl_coef=0.5, gamma=0.9, lambd=0.8
    )
    assert_close(adv, [[0.02744, 0.302, 0.6]])
    assert_close(ret, [[0.52744, 0.702, 0.9]])


def test_gae_skips_masked_tokens():
    # Same as above with a masked token (value 99, kl 5) inserted: it must not change anything.
    adv, ret = gae_advantages(
        [1.0],
        [t(1, 0, 1, 1)],
        values=[t(0.5, 99.0, 0.4, 0.3)],
        kl=[t(0.1, 5.0, 0.0, 0.2)],
        kl_coef=0.5,
        gamma=0.9,
        lambd=0.8,
    )
    assert_close(adv, [[0.02744, 0.0, 0.302, 0.6]])
    assert_close(ret, [[0.52744, 0.0, 0.702, 0.9]])


def test_gae_with_gamma_lambda_one_is_reward_minus_value():
    # gamma = lambd = 1, no KL: A_t = reward - V_t (telescoping sum), R_t = reward
    adv, ret = gae_advantages([2.0], [t(1, 1, 1)], values=[t(0.5, 1.0, 1.5)])
    assert_close(adv, [[1.5, 1.0, 0.5]])
    assert_close(ret, [[2.0, 2.0, 2.0]])


def test_gae_normalize_advantages_whitens_advantages_but_not_returns():
    # A = [0.02744, 0.302, 0.6]: mean 0.309813, population var 0.054668 -> (A - mean) / sqrt(var + 1e-6)
    adv, ret = gae_advantages(
        [1.0],
        [t(1, 1, 1)],
        values=[t(0.5, 0.4, 0.3)],
        kl=[t(0.1, 0.0, 0.2)],
        kl_coef=0.5,
        gamma=0.9,
        lambd=0.8,
        normalize_advantages=True,
    )
    assert_close(adv, [[-1.207683, -0.033417, 1.241100]])
    assert_close(ret, [[0.52744, 0.702, 0.9]])


def test_gae_needs_values():
    with pytest.raises(ValueError, match="critic values"):
        gae_advantages([1.0], [t(1)])
    with pytest.raises(ValueError, match="shape"):
        gae_advantages([1.0], [t(1, 1)], values=[t(0.5)])


# ---------------------------------------------------------------------------------------------- whitening


def test_whiten_ignores_masked_tokens():
    # Trainable [1, 3] (plus 5 in the second sample): mean 3, var ((4 + 0 + 4) / 3) = 8/3
    #   the masked 1000 and -1000 must not move the statistics.
    out = whiten([t(1.0, 3.0, 1000.0), t(-1000.0, 5.0)], [t(1, 1, 0), t(0, 1)], eps=0.0)
    std = (8 / 3) ** 0.5  # 1.632993
    assert_close(out, [[-2 / std, 0.0, 0.0], [0.0, 2 / std]])


def test_whiten_without_mean_shift_keeps_the_mean():
    # [1, 3]: mean 2, var 1 -> (x - 2) / 1 + 2 = [1, 3]; scaled [2, 6]: mean 4, std 2 -> [3, 5]
    assert_close(whiten([t(2.0, 6.0)], [t(1, 1)], eps=0.0, shift_mean=False), [[3.0, 5.0]])


def test_whiten_with_no_trainable_tokens_returns_zeros():
    assert_close(whiten([t(1.0, 2.0)], [t(0, 0)]), [[0.0, 0.0]])


# ---------------------------------------------------------------------------------------------- registry


def test_registry_lists_all_estimators_and_rejects_duplicates():
    assert list(ADVANTAGE_ESTIMATORS) == [
        "grpo",
        "gspo",
        "cispo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "ppo",
        "rloo",
        "remax",
    ]
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(lambda **kw: None)
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        get_advantage_estimator("nope")


def test_registered_estimator_is_callable_through_the_shared_keywords():
    @register_advantage_estimator("test_constant")
    def constant(rewards, loss_masks, **_):
        adv = [torch.full_like(m, 7.0) for m in loss_masks]
        return adv, adv

    try:
        kwargs = dict(n_samples_per_prompt=2, kl=None, values=None, kl_coef=0.0, gamma=1.0, lambd=1.0, eps=1e-6)
        adv, _ = get_advantage_estimator("test_constant")(rewards=[1.0, 0.0], loss_masks=[t(1), t(1, 1)], **kwargs)
        assert_close(adv, [[7.0], [7.0, 7.0]])
        # The built-ins accept the same keyword set without complaint.
        adv, _ = get_advantage_estimator("grpo")(rewards=[1.0, 0.0], loss_masks=[t(1), t(1, 1)], **kwargs)
        assert_close(adv, [[0.707106], [-0.707106, -0.707106]])
    finally:
        del ADVANTAGE_ESTIMATORS["test_constant"]


def test_grpo_leaves_samples_without_trainable_tokens_out_of_the_baseline():
    # group of 4: rewards 1, 0, 1 and a failed sample (placeholder reward 0, mask all zero)
    masks = [torch.ones(2), torch.ones(3), torch.ones(1), torch.zeros(2)]
    adv, _ = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), masks, n_samples_per_prompt=4, eps=0.0)
    # members 1, 0, 1: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    std = (1 / 3) ** 0.5
    assert torch.allclose(adv[0], torch.full((2,), (1 - 2 / 3) / std))
    assert torch.allclose(adv[1], torch.full((3,), (0 - 2 / 3) / std))
    assert torch.equal(adv[3], torch.zeros(2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_get_advantage_zero_and_stay_out_of_every_statistic(bad):
    # group of 4 with one non-finite reward: the others' advantages are those of the group without it
    masks = [torch.ones(2), torch.ones(3), torch.ones(1), torch.ones(2)]
    adv, _ = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, bad]), masks, n_samples_per_prompt=4, eps=0.0)
    std = (1 / 3) ** 0.5  # members 1, 0, 1: mean 2/3
    assert torch.allclose(adv[0], torch.full((2,), (1 - 2 / 3) / std))
    assert torch.allclose(adv[1], torch.full((3,), (0 - 2 / 3) / std))
    assert torch.equal(adv[3], torch.zeros(2))
    values = [torch.full((len(m),), 0.5) for m in masks]
    rewards = torch.tensor([1.0, 0.0, 1.0, bad])
    for name, kw in [("reinforce_plus_plus", {}), ("reinforce_plus_plus_baseline", {}),
                     ("ppo", {"values": values, "normalize_advantages": True})]:
        adv, returns = get_advantage_estimator(name)(rewards, masks, n_samples_per_prompt=4, **kw)
        assert all(torch.isfinite(a).all() and torch.isfinite(r).all() for a, r in zip(adv, returns)), name
        assert torch.equal(adv[3], torch.zeros(2)) and torch.equal(returns[3], torch.zeros(2)), name
        kw = {k: v[:3] if k == "values" else v for k, v in kw.items()}
        clean, _ = get_advantage_estimator(name)(rewards[:3], masks[:3], n_samples_per_prompt=3, **kw)
        assert_close(adv[:3], clean)  # as if the sample were absent


def test_masked_mean_std_by_hand():
    """Values 1, 2, 4 on the trainable tokens: mean 7/3, population std sqrt(42/27); masked tokens ignored."""
    from vime.algorithms import masked_mean_std

    xs = [torch.tensor([1.0, 2.0, 30.0]), torch.tensor([4.0, -50.0])]
    masks = [torch.tensor([1, 1, 0]), torch.tensor([1, 0])]
    mean, std = masked_mean_std(xs, masks)
    assert mean == pytest.approx(7 / 3, abs=1e-6) and std == pytest.approx((42 / 27) ** 0.5, abs=1e-6)
    assert masked_mean_std(xs, [torch.zeros(3), torch.zeros(2)]) == (0.0, 0.0)
    whitened = whiten(xs, masks)
    assert masked_mean_std(whitened, masks) == pytest.approx((0.0, 1.0), abs=1e-5)


# ---------------------------------------------------------------------------------------------- rloo / remax


def test_rloo_baseline_is_the_mean_of_the_other_members():
    # Group 1 rewards [1, 0, 0, 1]: the others' means 1/3, 2/3, 2/3, 1/3 -> A = 2/3, -2/3, -2/3, 2/3
    # Group 2 rewards [3, 1, 2, 9], the last without trainable tokens (no member): k = 3
    #   A = 3 - (1 + 2)/2 = 1.5,  1 - (3 + 2)/2 = -1.5,  2 - (3 + 1)/2 = 0,  and 0 for the non-member
    rewards = [1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 9.0]
    masks = [t(1, 0), t(1), t(1, 1), t(1), t(1), t(1, 1), t(1), t(0, 0)]
    adv, ret = rloo_advantages(rewards, masks, n_samples_per_prompt=4)
    assert_close(adv, [[2 / 3, 0.0], [-2 / 3], [-2 / 3, -2 / 3], [2 / 3], [1.5], [-1.5, -1.5], [0.0], [0.0, 0.0]])
    assert ret is adv


def test_rloo_is_n_over_n_minus_1_times_the_group_centred_reward():
    torch.manual_seed(1)
    rewards = torch.rand(8)
    masks = [torch.ones(1) for _ in range(8)]
    rloo, _ = rloo_advantages(rewards, masks, n_samples_per_prompt=4)
    centred, _ = grpo_advantages(rewards, masks, n_samples_per_prompt=4, normalize_std=False)
    torch.testing.assert_close(torch.cat(rloo), torch.cat(centred) * 4 / 3, atol=1e-6, rtol=0)


def test_rloo_lone_member_nan_reward_and_group_size():
    # group [5, NaN]: the NaN sample is no member, so 5 has no other sample to compare with -> 0
    adv, _ = rloo_advantages([5.0, float("nan")], [t(1), t(1)], n_samples_per_prompt=2)
    assert_close(adv, [[0.0], [0.0]])
    with pytest.raises(ValueError, match="n-samples-per-prompt >= 2"):
        rloo_advantages([1.0], [t(1)], n_samples_per_prompt=1)


def test_remax_subtracts_the_greedy_reward():
    # rewards [1, 0, 0.5], greedy baselines [0.5, 0.5, NaN] -> 0.5, -0.5, and 0 for the one without a baseline
    adv, ret = remax_advantages([1.0, 0.0, 0.5], [t(1, 1), t(0, 1), t(1)], greedy_rewards=[0.5, 0.5, float("nan")],
                                n_samples_per_prompt=3)
    assert_close(adv, [[0.5, 0.5], [0.0, -0.5], [0.0]])
    assert ret is adv
    with pytest.raises(ValueError, match="greedy baseline"):
        remax_advantages([1.0], [t(1)])
    with pytest.raises(ValueError, match="2 greedy rewards but 1 rewards"):
        remax_advantages([1.0], [t(1)], greedy_rewards=[0.0, 1.0])
