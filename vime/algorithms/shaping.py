"""Reward and mask shaping before the advantages, and the entropy coefficient's schedule: pure functions of plain
numbers and 0/1 masks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def overlong_penalties(response_lengths: Sequence[int], max_response_len: int, buffer_len: int,
                       penalty_factor: float = 1.0) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's `overlong_buffer`): with the expected length
    L = max_response_len - buffer_len, a response of |y| tokens gets

        0                                         |y| <= L
        -(|y| - L) / buffer_len * penalty_factor   L < |y| <= max_response_len   (linear in the buffer)
        -penalty_factor                            |y| > max_response_len

    added to its reward."""
    if buffer_len < 1 or buffer_len > max_response_len:
        raise ValueError(f"the overlong buffer ({buffer_len} tokens) must lie in [1, max_response_len "
                         f"{max_response_len}]")
    expected = max_response_len - buffer_len
    return [max(-penalty_factor, min(0.0, -(n - expected) / buffer_len * penalty_factor)) for n in response_lengths]


def mask_truncated(loss_masks: list[torch.Tensor], truncated: Sequence[bool]) -> tuple[list[torch.Tensor], int]:
    """DAPO's overlong filtering: a truncated sample (cut at the length limit, no answer) is masked out of the loss
    (all-zero mask; it then also joins no group baseline or whitening). Returns the masks and how many samples
    with trainable tokens were masked."""
    if len(loss_masks) != len(truncated):
        raise ValueError(f"{len(loss_masks)} loss masks but {len(truncated)} truncation flags")
    masked = sum(1 for m, cut in zip(loss_masks, truncated) if cut and bool(m.any()))
    return [torch.zeros_like(m) if cut else m for m, cut in zip(loss_masks, truncated)], masked


def entropy_coef_at(rollout_id: int, start: float, final: float, decay_rollouts: int | None,
                    schedule: str = "constant") -> float:
    """The entropy bonus's coefficient for rollout `rollout_id`: `start` throughout (constant), or moving from
    `start` at rollout 0 to `final` at rollout `decay_rollouts` and staying there, linearly or on a half cosine
    (final + (start - final) * (1 + cos(pi * p)) / 2, p the fraction of the way)."""
    if schedule == "constant":
        return start
    if not decay_rollouts or decay_rollouts < 1:
        raise ValueError(f"the {schedule} entropy coefficient schedule needs decay_rollouts >= 1")
    progress = min(1.0, max(0.0, rollout_id / decay_rollouts))
    if schedule == "linear":
        return start + (final - start) * progress
    if schedule == "cosine":
        return final + (start - final) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown entropy coefficient schedule {schedule!r}")
