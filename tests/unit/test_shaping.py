"""DAPO's overlong shaping and filtering, and the entropy coefficient's schedule, against hand-computed values
(vime/algorithms/shaping.py)."""

import math

import pytest
import torch

from vime.algorithms.shaping import entropy_coef_at, mask_truncated, overlong_penalties


def test_overlong_penalty_grows_linearly_in_the_buffer():
    # max 16, buffer 8: expected length 8; 9 tokens -> -(9 - 8) / 8 = -0.125, 12 -> -0.5, 16 -> -1, 20 -> -1 (cap)
    assert overlong_penalties([5, 8, 9, 12, 16, 20], 16, 8) == pytest.approx([0.0, 0.0, -0.125, -0.5, -1.0, -1.0])
    assert overlong_penalties([9, 12, 16, 20], 16, 8, penalty_factor=0.5) == \
        pytest.approx([-0.0625, -0.25, -0.5, -0.5])
    assert overlong_penalties([15, 16], 16, 1) == pytest.approx([0.0, -1.0])  # a one-token buffer
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalties([1], 16, 17)


def test_mask_truncated_zeroes_truncated_samples_and_counts_the_trainable_ones():
    masks = [torch.tensor([1.0, 1.0]), torch.tensor([1.0]), torch.tensor([0.0, 0.0])]
    out, masked = mask_truncated(masks, [True, False, True])
    assert [m.tolist() for m in out] == [[0.0, 0.0], [1.0], [0.0, 0.0]]
    assert masked == 1  # the third had no trainable token already
    with pytest.raises(ValueError, match="3 loss masks but 2"):
        mask_truncated(masks, [True, False])


def test_entropy_coefficient_schedules():
    assert entropy_coef_at(7, 0.01, 0.0, None, "constant") == 0.01
    # linear from 0.01 to 0 over 10 rollouts: 0.005 halfway, 0 from rollout 10 on
    assert [entropy_coef_at(r, 0.01, 0.0, 10, "linear") for r in (0, 5, 10, 20)] == \
        pytest.approx([0.01, 0.005, 0.0, 0.0])
    # cosine: 0.01 * (1 + cos(pi * p)) / 2; p = 0.25 -> 0.005 * (1 + 0.707107) = 0.0085355
    assert entropy_coef_at(0, 0.01, 0.0, 10, "cosine") == pytest.approx(0.01)
    assert entropy_coef_at(5, 0.01, 0.0, 10, "cosine") == pytest.approx(0.005)
    assert entropy_coef_at(2.5, 0.01, 0.0, 10, "cosine") == pytest.approx(0.005 * (1 + math.sqrt(0.5)))
    assert entropy_coef_at(3, 0.0, 0.02, 6, "linear") == pytest.approx(0.01)  # it may rise, too
    with pytest.raises(ValueError, match="decay_rollouts"):
        entropy_coef_at(0, 0.01, 0.0, None, "linear")
