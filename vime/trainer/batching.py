"""How one rollout becomes optimizer steps, data-parallel shards and micro-batches. Pure functions on lengths.

A rollout of N samples gives N / --global-batch-size optimizer steps (--num-steps-per-rollout must agree).
Each step's samples are dealt to data-parallel ranks with equal counts and balanced token totals; each rank cuts
its share into micro-batches of --micro-batch-size samples, or, with --use-dynamic-batch-size, of at most
--max-tokens-per-gpu tokens (real tokens when packed, --qkv-format thd; padded ones with bshd). A micro-batch
becomes model inputs packed one sequence after another, or right-padded (`micro_batch_inputs`). Packed, the
samples of a micro-batch that share a prompt (a GRPO group) can share one copy of it (`share_prompts`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

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
                  max_tokens: int | None = None, packed: bool = False) -> list[list[int]]:
    """Fixed-size micro-batches, or (max_tokens set) micro-batches of similar lengths whose size stays within
    max_tokens: the sum of their lengths when packed, count x longest when padded. A single longer sample gets a
    micro-batch of its own."""
    if max_tokens is None:
        return [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    batches: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for i in sorted(indices, key=lambda i: (lengths[i], i)):  # similar lengths together: less padding
        new_longest, new_total = max(longest, lengths[i]), total + lengths[i]
        size = new_total if packed else new_longest * (len(current) + 1)
        if current and size > max_tokens:
            batches.append(current)
            current, new_longest, new_total = [], lengths[i], lengths[i]
        current.append(i)
        longest, total = new_longest, new_total
    if current:
        batches.append(current)
    return batches


def pad_tokens(token_lists: list[list[int]], pad_id: int = 0, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to [batch, longest] (longest rounded up to a multiple of `multiple`); returns (tokens,
    position_ids). Causal attention makes right padding harmless to every real position."""
    longest = _round_up(max(len(t) for t in token_lists), multiple)
    tokens = torch.full((len(token_lists), longest), pad_id, dtype=torch.long)
    for row, t in enumerate(token_lists):
        tokens[row, : len(t)] = torch.tensor(t, dtype=torch.long)
    positions = torch.arange(longest, dtype=torch.long).unsqueeze(0).expand(len(token_lists), -1).contiguous()
    return tokens, positions


@dataclass
class MicroBatchInputs:
    """What one micro-batch feeds the model, and where its response tokens' logits come from.

    Packed (`cu_seqlens` set): the sequences one after another in a single row, tokens [1, T] with T the sum of
    their lengths, positions restarting at 0 for each. Padded: tokens [b, longest], right-padded.
    `logit_rows` index the model's flattened [seq x batch] hidden states at each response token's predecessor
    (the position whose logits predict it), in sample order; `targets` are those response tokens.
    With shared prompts (`segment_prefix` set) a packed segment is a prompt, a response that continues the
    prompt segment `segment_prefix[s]` (its positions carry on from the prompt's), or a whole sample (-1).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None  # int32 [n + 1] sequence boundaries in the packed row
    max_seqlen: int  # the longest sequence (with shared prompts: prompt + response)
    logit_rows: torch.Tensor  # [R] long, R = sum of response lengths
    targets: torch.Tensor  # [R] long
    response_lengths: list[int]
    segment_prefix: list[int] | None = None  # per packed segment: the prompt segment it continues, or -1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def micro_batch_inputs(token_lists: list[list[int]], response_lengths: list[int], packed: bool = True,
                       pad_id: int = 0, multiple: int = 1, share_prompts: bool = False) -> MicroBatchInputs:
    """Model inputs for one micro-batch: packed without padding (`thd`), or right-padded (`bshd`).

    `multiple`: the sequence dimension is padded to a multiple of it (sequence parallel splits it over the TP
    ranks): packed, with one extra sequence of `pad_id` tokens at the end of the row (in `cu_seqlens`, so it
    attends only to itself); padded, with more right padding. `logit_rows` never point into the padding.
    `share_prompts` (packed only): see `shared_prompt_inputs`."""
    if packed and share_prompts:
        shared = shared_prompt_inputs(token_lists, response_lengths, pad_id, multiple)
        if shared is not None:
            return shared
    lengths = [len(t) for t in token_lists]
    flat = torch.tensor([tok for t in token_lists for tok in t], dtype=torch.long)
    starts = torch.tensor([0] + lengths[:-1], dtype=torch.long).cumsum(0)
    # the response token j of sample k sits at start_k + len_k - resp_k + j; its logits one position earlier
    first = [s + n - r for s, n, r in zip(starts.tolist(), lengths, response_lengths)]
    in_row = torch.cat([torch.arange(f, f + r) for f, r in zip(first, response_lengths)]) if first else \
        torch.zeros(0, dtype=torch.long)
    targets = flat[in_row]
    if packed:
        pad = _round_up(len(flat), multiple) - len(flat)
        segments = lengths + [pad] if pad else lengths
        row = torch.cat([flat, torch.full((pad,), pad_id, dtype=torch.long)])
        positions = torch.cat([torch.arange(n) for n in segments])
        cu = torch.tensor([0, *segments], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return MicroBatchInputs(row.unsqueeze(0), positions.unsqueeze(0), cu, max(segments), in_row - 1, targets,
                                list(response_lengths))
    tokens, positions = pad_tokens(token_lists, pad_id, multiple)
    batch = len(token_lists)
    rows = torch.cat([torch.arange(n - r - 1, n - 1) * batch + b
                      for b, (n, r) in enumerate(zip(lengths, response_lengths))])  # [seq, batch] flattened
    return MicroBatchInputs(tokens, positions, None, max(lengths), rows, targets, list(response_lengths))


MAX_PROMPT_MASK_BYTES = 256 * 2**20  # the largest shared-prompt attention mask a micro-batch may build


def shared_prompt_inputs(token_lists: list[list[int]], response_lengths: list[int], pad_id: int = 0,
                         multiple: int = 1) -> MicroBatchInputs | None:
    """Packed inputs in which the samples that share a prompt (equal tokens before the response) hold one copy of
    it: [prompt, response 1, ..., response k] instead of k whole sequences. Each response attends to its prompt
    and to itself (`attention.SDPAttention`), at the positions it has in its own sequence, so every response
    token sees what it would see alone: the same logits, loss and gradients, while the prompt's tokens go through
    the model once per micro-batch instead of once per sample (a GRPO group of 8 with a prompt a third of its
    tokens: 29% fewer tokens). The first response token's logits come from the prompt's last row, which the
    group shares. None when no prompt is shared (the plain packed layout is the same then), or when the
    responses' attention mask (responses x longest response x longest whole sequence, one byte each) would
    exceed `MAX_PROMPT_MASK_BYTES`: long sequences keep the plain layout rather than a mask of gigabytes."""
    prompts = [tuple(t[: len(t) - r]) for t, r in zip(token_lists, response_lengths)]
    counts: dict[tuple, int] = {}
    for prompt, r in zip(prompts, response_lengths):
        if prompt and r > 0:
            counts[prompt] = counts.get(prompt, 0) + 1
    if not any(c > 1 for c in counts.values()):
        return None
    shared = [(n, r) for n, r, prompt in zip(map(len, token_lists), response_lengths, prompts)
              if r > 0 and counts.get(prompt, 0) > 1]
    if len(shared) * max(r for _, r in shared) * max(n for n, _ in shared) > MAX_PROMPT_MASK_BYTES:
        return None
    segments: list[list[int]] = []  # token ids of each packed segment
    prefix: list[int] = []  # the prompt segment each continues, or -1
    first_position: list[int] = []  # the position of each segment's first token in its own sequence

    def add(tokens: list[int], continues: int = -1, position: int = 0) -> int:
        segments.append(list(tokens))
        prefix.append(continues)
        first_position.append(position)
        return len(segments) - 1

    prompt_segment: dict[tuple, int] = {}
    response_at: list[tuple[int, int]] = []  # per sample: its segment, the offset of its response in it
    for t, r, prompt in zip(token_lists, response_lengths, prompts):
        if counts.get(prompt, 0) > 1 and r > 0:
            if prompt not in prompt_segment:
                prompt_segment[prompt] = add(prompt)
            response_at.append((add(t[len(t) - r:], prompt_segment[prompt], len(prompt)), 0))
        else:
            response_at.append((add(t), len(t) - r))
    total = sum(len(s) for s in segments)
    if _round_up(total, multiple) > total:
        add([pad_id] * (_round_up(total, multiple) - total))
    lengths = [len(s) for s in segments]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    rows, targets = [], []
    for (seg, offset), r in zip(response_at, response_lengths):
        # the logits predicting response token j sit one position before it: in the prompt for j = 0 when shared
        first = starts[seg] + offset
        pred = list(range(first - 1, first + r - 1))
        if prefix[seg] >= 0 and r:
            pred[0] = starts[prefix[seg] + 1] - 1
        rows += pred
        targets += segments[seg][offset:offset + r]
    row = torch.tensor([tok for s in segments for tok in s], dtype=torch.long)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(first_position, lengths)])
    return MicroBatchInputs(row.unsqueeze(0), positions.unsqueeze(0), torch.tensor(starts, dtype=torch.int32),
                            max(p + n for p, n in zip(first_position, lengths)), torch.tensor(rows, dtype=torch.long),
                            torch.tensor(targets, dtype=torch.long), list(response_lengths), prefix)


@dataclass(frozen=True)
class SplitRule:
    """How a rollout is cut for training: its optimizer steps, data-parallel shares and micro-batches."""

    dp_size: int
    global_batch_size: int
    micro_batch_size: int
    max_tokens: int | None = None  # --use-dynamic-batch-size: tokens per micro-batch instead of samples
    packed: bool = True  # thd: real tokens count; bshd: padded ones


def rank_share(rule: SplitRule, loss_masks: list, step, lengths: list[int], dp_rank: int,
               every_sample: bool = False) -> tuple[list[int], list[list[int]]]:
    """Data-parallel rank `dp_rank`'s samples of `step` and its micro-batches (every rank derives every rank's).
    A sample with no trainable token (failed, aborted, fully masked) adds nothing to the loss, so it is left out of
    the micro-batches and never computed (`every_sample` keeps it: the critic's values cover every sample); a rank
    whose share is all such samples still runs one micro-batch, of zero loss, to take part in the step."""
    local = balanced_partition(list(step), lengths, rule.dp_size)[dp_rank]
    computed = local if every_sample else [i for i in local if loss_masks[i].any()] or local[:1]
    if rule.max_tokens is not None:
        return local, micro_batches(computed, lengths, max_tokens=rule.max_tokens, packed=rule.packed)
    return local, micro_batches(computed, lengths, micro_batch_size=rule.micro_batch_size)


def split_rollout(rule: SplitRule, loss_masks: list, lengths: list[int], dp_rank: int,
                  every_sample: bool = False) -> list[tuple[range, list[int], list[list[int]]]]:
    """Per optimizer step: (the step's sample positions, this rank's share, its micro-batches)."""
    return [(step, *rank_share(rule, loss_masks, step, lengths, dp_rank, every_sample))
            for step in step_slices(len(lengths), rule.global_batch_size)]
