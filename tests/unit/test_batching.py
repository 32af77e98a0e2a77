"""How a rollout becomes optimizer steps, data-parallel shares and micro-batches (pure functions on lengths)."""

from __future__ import annotations

import random

import pytest
import torch

from vime.trainer.batching import balanced_partition, micro_batches, pad_tokens, step_slices


def test_step_slices_cut_consecutive_ranges():
    assert step_slices(12, 4) == [range(0, 4), range(4, 8), range(8, 12)]
    assert step_slices(8, 8) == [range(0, 8)]


@pytest.mark.parametrize("num_samples, global_batch_size", [(10, 4), (3, 4)])
def test_step_slices_reject_a_remainder(num_samples, global_batch_size):
    with pytest.raises(ValueError, match="--global-batch-size"):
        step_slices(num_samples, global_batch_size)


def test_balanced_partition_hand_checked():
    lengths = [10, 9, 8, 7, 2, 1]
    # Longest first, each to the lightest part with room: 10->A, 9->B, 8->B, 7->A, 2->A (tie, lower part), 1->B.
    assert balanced_partition(list(range(6)), lengths, 2) == [[0, 3, 4], [1, 2, 5]]  # 19 and 18 tokens
    # Equal counts win over token balance: 1 and 2 go to the light part, which is then full, so 3 joins 100.
    assert balanced_partition([0, 1, 2, 3], [100, 1, 1, 1], 2) == [[0, 3], [1, 2]]


def test_balanced_partition_of_a_later_step_uses_global_positions():
    lengths = [1] * 4 + [50, 40, 5, 6]
    parts = balanced_partition(list(range(4, 8)), lengths, 2)
    assert parts == [[4, 6], [5, 7]]  # 55 and 46 tokens, not 90 and 11 as a contiguous split would give


def test_balanced_partition_equal_counts_and_balance_on_random_lengths():
    rng = random.Random(0)
    lengths = [rng.randint(1, 500) for _ in range(64)]
    parts = balanced_partition(list(range(64)), lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert [len(p) for p in parts] == [16] * 4
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # far better than a contiguous split would be in general
    contiguous = [sum(lengths[i] for i in range(k * 16, k * 16 + 16)) for k in range(4)]
    assert max(loads) - min(loads) < max(contiguous) - min(contiguous)
    assert parts == balanced_partition(list(range(64)), lengths, 4)  # deterministic: every rank computes it


def test_balanced_partition_rejects_uneven_counts():
    with pytest.raises(ValueError, match="data-parallel"):
        balanced_partition([0, 1, 2], [1, 2, 3], 2)


def test_fixed_micro_batches_keep_order():
    assert micro_batches([3, 5, 7, 9], [1] * 10, micro_batch_size=2) == [[3, 5], [7, 9]]
    assert micro_batches([0, 1, 2, 3, 4, 5], [1] * 6, micro_batch_size=3) == [[0, 1, 2], [3, 4, 5]]


def test_dynamic_micro_batches_hand_checked():
    lengths = [5, 3, 8, 4, 20]
    # Shortest first: [3, 4] pads to 2 x 4 = 8; adding 5 would pad to 15 > 12; 5 and 8 together 16 > 12;
    # 20 alone is over the bound and still gets a micro-batch of its own.
    assert micro_batches([0, 1, 2, 3, 4], lengths, max_tokens=12) == [[1, 3], [0], [2], [4]]


def test_dynamic_micro_batches_respect_the_token_bound():
    rng = random.Random(1)
    lengths = [rng.randint(1, 300) for _ in range(100)] + [700]  # the last one alone exceeds the bound
    indices = list(range(0, 101, 2)) + [100]
    indices = sorted(set(indices))
    mbs = micro_batches(indices, lengths, max_tokens=600)
    assert sorted(i for mb in mbs for i in mb) == indices
    for mb in mbs:
        padded = len(mb) * max(lengths[i] for i in mb)
        assert padded <= 600 or len(mb) == 1
    assert [100] in mbs
    assert len(mbs) < len(indices) / 2  # it packs, rather than one sample per micro-batch


def test_packed_dynamic_micro_batches_count_real_tokens():
    lengths = [5, 3, 8, 4, 20]
    # Shortest first: 3 + 4 + 5 = 12 fits; + 8 = 20 > 12; 8 alone; 20 alone (over the bound)
    assert micro_batches([0, 1, 2, 3, 4], lengths, max_tokens=12, packed=True) == [[1, 3, 0], [2], [4]]


def test_pad_tokens_right_pads_and_numbers_positions():
    tokens, positions = pad_tokens([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert tokens.dtype == positions.dtype == torch.long
    assert positions.tolist() == [[0, 1, 2]] * 3
