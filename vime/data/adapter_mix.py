"""Multi-LoRA prompt data (--lora-adapters): several adapters' prompt files behind one data source.

Each adapter reads its own prompts in its own order (epochs, and a shuffle seeded by --rollout-seed and the
adapter's name); every call hands out an equal share of groups per adapter, the remainder of an uneven call going
to the next adapters in turn, so that over calls every adapter gets as many. Every sample carries its adapter's
name in `metadata[ADAPTER_KEY]`; indices and group indices run over the whole run as with one prompt file. Groups
given back (`add_samples`) keep their tag and are served first, counted in their adapter's share.
"""

from __future__ import annotations

import zlib

from vime.data.data_source import RolloutDataSource
from vime.data.sample import ADAPTER_KEY, Sample
from vime.data.sample_codec import json_ready


def adapter_seed(seed: int, name: str) -> int:
    """The shuffle seed of an adapter's prompts: its own, and the same whatever other adapters the run has."""
    return seed + zlib.crc32(name.encode())


class AdapterMixSource(RolloutDataSource):
    """`RolloutDataSource`'s interface over {adapter name: prompts}: this source numbers the samples and keeps the
    groups given back; one `RolloutDataSource` per adapter gives that adapter's prompt order."""

    def __init__(self, prompts: dict[str, list[Sample]], n_samples_per_prompt: int, seed: int, shuffle: bool,
                 buffer_filter=None):
        if not prompts or not all(prompts.values()):
            raise ValueError("AdapterMixSource needs at least one prompt per adapter")
        super().__init__([p for ps in prompts.values() for p in ps], n_samples_per_prompt, seed, shuffle,
                         buffer_filter)
        self.names = list(prompts)
        self.orders = {name: RolloutDataSource(ps, 1, adapter_seed(seed, name), shuffle)
                       for name, ps in prompts.items()}
        self.rotation = 0  # the first adapter to get one more group when a call does not split evenly

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` groups, `num_groups // adapters` per adapter and one more for the next `num_groups %
        adapters` adapters in turn: the groups given back first (counted in their adapter's share), then fresh
        ones, one adapter after the other."""
        base, extra = divmod(num_groups, len(self.names))
        turn = self.names[self.rotation:] + self.names[:self.rotation]
        self.rotation = (self.rotation + extra) % len(self.names)
        left = {name: base + (k < extra) for k, name in enumerate(turn)}
        groups = self.take_buffered(num_groups)
        for group in groups:
            name = group[0].metadata.get(ADAPTER_KEY)
            if name in left:
                left[name] -= 1
        while len(groups) < num_groups:  # the shares left cover the groups missing: each pass adds at least one
            for name in [n for n in turn if left[n] > 0][:num_groups - len(groups)]:
                left[name] -= 1
                groups.append(self.new_group(self.orders[name].next_prompt()))
                for sample in groups[-1]:
                    sample.metadata[ADAPTER_KEY] = name
        return groups

    def state_dict(self) -> dict:
        return {
            "next_sample_index": self.next_sample_index,
            "next_group_index": self.next_group_index,
            "rotation": self.rotation,
            "adapters": {name: {"epoch": o.epoch, "offset": o.offset} for name, o in self.orders.items()},
            "buffer": [[json_ready(s.to_dict()) for s in g] for g in self.buffer],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` left off; an adapter the state does not know starts at its beginning."""
        self.next_sample_index = state["next_sample_index"]
        self.next_group_index = state["next_group_index"]
        self.rotation = state.get("rotation", 0) % len(self.names)
        self.buffer = [[Sample.from_dict(d) for d in g] for g in state.get("buffer", [])]
        for name, position in (state.get("adapters") or {}).items():
            if name in self.orders:
                order = self.orders[name]
                order.load_state_dict({**order.state_dict(), **position})
