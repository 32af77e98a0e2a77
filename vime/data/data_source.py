"""The rollout data source: hands out groups of prompt samples epoch by epoch, resumable.

Its state (epoch, offset, next sample index) is a small dict saved beside model checkpoints, so a resumed
run continues with the same data order. Samples pushed back (`add_samples`, e.g. aborted partial rollouts)
are served before fresh prompts.
"""

from __future__ import annotations

import copy
import random

from vime.data.sample import Sample
from vime.data.sample_codec import json_ready


class RolloutDataSource:
    def __init__(self, prompts: list[Sample], n_samples_per_prompt: int, seed: int, shuffle: bool,
                 buffer_filter=None):
        if not prompts:
            raise ValueError("RolloutDataSource needs at least one prompt")
        self.prompts = prompts
        self.n_samples_per_prompt = n_samples_per_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0  # position within the current epoch's order
        self.next_sample_index = 0
        self.next_group_index = 0
        self.buffer: list[list[Sample]] = []  # groups returned for another try (partial rollout)
        self.buffer_filter = buffer_filter  # (buffer, num_groups) -> groups taken out of it; default oldest first
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        """The number of prompts (what --num-epoch counts)."""
        return len(self.prompts)

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` groups: those given back first, then `n_samples_per_prompt` fresh copies of the next
        prompts."""
        groups = self.take_buffered(num_groups)
        while len(groups) < num_groups:
            groups.append(self.new_group(self.next_prompt()))
        return groups

    def take_buffered(self, num_groups: int) -> list[list[Sample]]:
        """Up to `num_groups` groups out of the buffer (--buffer-filter-path picks them; default oldest first)."""
        if self.buffer_filter is not None:
            return list(self.buffer_filter(self.buffer, num_groups))
        groups = self.buffer[:num_groups]
        del self.buffer[:num_groups]
        return groups

    def next_prompt(self) -> Sample:
        """The next prompt in epoch order (the stored one, not a copy); past the last, the next epoch's order."""
        if self.offset >= len(self._order):
            self.epoch += 1
            self.offset = 0
            self._order = self._epoch_order(self.epoch)
        prompt = self.prompts[self._order[self.offset]]
        self.offset += 1
        return prompt

    def new_group(self, prompt: Sample) -> list[Sample]:
        """`n_samples_per_prompt` copies of `prompt`: the next group index, the next consecutive sample indices
        (they seed sampling and identify samples for the whole run)."""
        group = []
        for _ in range(self.n_samples_per_prompt):
            sample = copy.deepcopy(prompt)
            sample.group_index = self.next_group_index
            sample.index = self.next_sample_index
            self.next_sample_index += 1
            group.append(sample)
        self.next_group_index += 1
        return group

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Give groups back; they are served before fresh prompts, oldest first."""
        self.buffer = self.buffer + list(groups)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "next_sample_index": self.next_sample_index,
            "next_group_index": self.next_group_index,
            "buffer": [[json_ready(s.to_dict()) for s in g] for g in self.buffer],
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.offset = state["offset"]
        self.next_sample_index = state["next_sample_index"]
        self.next_group_index = state["next_group_index"]
        self.buffer = [[Sample.from_dict(d) for d in g] for g in state.get("buffer", [])]
        self._order = self._epoch_order(self.epoch)
