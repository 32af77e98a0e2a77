"""How one rollout becomes optimizer steps, data-parallel shards and micro-batches. Pure functions on lengths.

A rollout of N samples gives N / --global-batch-size optimizer steps (--num-steps-per-rollout must agree).
Each step's samples are dealt to data-parallel ranks with equal counts and balanced token totals; each rank cuts
its share into micro-batches of --micro-batch-size samples, or, with --use-dynamic-batch-size, of at most
--max-tokens-per-gpu padded tokens.
"""

from __future__ import annotations

import heapq

import torch


def step_slices(num_samples: int, global_batch_size: int) -> list[range]:
    """Consecutive ranges of sample positions, one per optimizer step."""
    if num_samples % global_batch_size:
        raise ValueError(f"a rollout of {num_samples} samples does not split into --global-batch-size "
                         f"{global_batch_size} batches; make rollout-batch-size x n-samples-per-prompt a multiple")
    return [range(i, i + global_batch_size) for i in range(0, num_samples, global_batch_size)]


def balanced_partition(indices: list[int], lengths: list[int], num_parts: int) -> list[list[int]]:
    """Split `indices` into `num_parts` lists of equal size with token totals as even as a greedy deal allows
    (longest first, each to the lightest part that still has room). Deterministic."""
    if len(indices) % num_parts:
        raise ValueError(f"{len(indices)} samples cannot be split evenly over {num_parts} data-parallel ranks")
    capacity = len(indices) // num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0, p) for p in range(num_parts)]
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    for i in order:
        skipped = []
        load, p = heapq.heappop(heap)
        while len(parts[p]) >= capacity:
            skipped.append((load, p))
            load, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (load + lengths[i], p))
        for item in skipped:
            heapq.heappush(heap, item)
    return [sorted(part) for part in parts]


def micro_batches(indices: list[int], lengths: list[int], micro_batch_size: int | None = None,
                  max_tokens: int | None = None) -> list[list[int]]:
    """Fixed-size micro-batches, or (max_tokens set) micro-batches whose padded size
    (count x longest) stays within max_tokens; a single longer sample gets a micro-batch of its own."""
    if max_tokens is None:
        return [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in sorted(indices, key=lambda i: (lengths[i], i)):  # similar lengths together: less padding
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def pad_tokens(token_lists: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to [batch, longest]; returns (tokens, position_ids). Causal attention makes right padding
    harmless to every real position."""
    longest = max(len(t) for t in token_lists)
    tokens = torch.full((len(token_lists), longest), pad_id, dtype=torch.long)
    for row, t in enumerate(token_lists):
        tokens[row, : len(t)] = torch.tensor(t, dtype=torch.long)
    positions = torch.arange(longest, dtype=torch.long).unsqueeze(0).expand(len(token_lists), -1).contiguous()
    return tokens, positions
