"""Deterministic synthetic rollouts for trainer tests and benchmarks: no engine, no reward function.

A rollout is what `MegatronTrainer.train` receives: a list of GRPO groups, each a list of `Sample.to_dict()`
dicts. Prompts have varied lengths, responses are random token ids from a seeded generator, and every group
mixes rewarded (1.0) and unrewarded (0.0) responses so that GRPO advantages are never all zero.
"""

from __future__ import annotations

import torch

from vime.data.sample import Sample


def make_rollout(seed: int = 0, num_prompts: int = 4, group_size: int = 4, prompt_lengths: tuple[int, int] = (4, 20),
                 response_lengths: tuple[int, int] = (6, 16), vocab: tuple[int, int] = (5, 500)) -> list[list[dict]]:
    """Groups of Sample dicts; lengths are drawn uniformly from the inclusive (low, high) ranges.

    Within each group between one and group_size - 1 responses get reward 1.0, the rest 0.0."""
    g = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    groups = []
    for p in range(num_prompts):
        prompt = torch.randint(*vocab, (randint(*prompt_lengths),), generator=g).tolist()
        rewarded = set(torch.randperm(group_size, generator=g)[: randint(1, group_size - 1)].tolist())
        group = []
        for k in range(group_size):
            response = torch.randint(*vocab, (randint(*response_lengths),), generator=g).tolist()
            group.append(Sample(group_index=p, index=p * group_size + k, tokens=prompt + response,
                                response_length=len(response), reward=1.0 if k in rewarded else 0.0,
                                status=Sample.Status.COMPLETED).to_dict())
        groups.append(group)
    return groups


def flat(groups: list[list[dict]]) -> list[dict]:
    return [s for group in groups for s in group]
