"""A data source class written for slime (`--data-source-path`), behind the interface vime's rollout manager uses.

slime makes it as `cls(args)` and calls `get_samples(num_groups) -> list[list[Sample]]`, `add_samples(groups)`,
`save(rollout_id)` when it checkpoints, `load(rollout_id)` when it resumes, and `len()`. vime keeps each rollout's
data-source state beside its checkpoint (the state right after that rollout was generated, which an async run
needs); for a slime class that state is the rollout id it last saved at, and a resume calls `load` with it.
"""

from __future__ import annotations

from typing import Any

from vime.data.sample import Sample

REQUIRED = ("get_samples", "add_samples")


class SlimeDataSource:
    def __init__(self, source: Any, path: str, saves: bool):
        """`source`: the instance; `path`: --data-source-path (for errors); `saves`: a checkpoint directory exists
        (--save), so `save(rollout_id)` is called after each rollout (slime's classes write under it)."""
        missing = [m for m in REQUIRED if not callable(getattr(source, m, None))]
        if missing:
            raise TypeError(f"--data-source-path {path}: {type(source).__name__} has no {', '.join(missing)}; a data "
                            "source needs get_samples(num_groups) -> list[list[Sample]] and add_samples(groups)")
        self.source, self.path, self.saves = source, path, saves
        self.saved_at: int | None = None

    def __len__(self) -> int:
        """What vime counts for --num-epoch: `len(source)` prompts (slime's DataSource defines __len__)."""
        try:
            return len(self.source)
        except TypeError:
            raise TypeError(f"--data-source-path {self.path}: {type(self.source).__name__} has no len(); --num-epoch "
                            "needs the number of prompts (or give --num-rollout)") from None

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = self.source.get_samples(num_groups)
        if not isinstance(groups, list) or not all(isinstance(g, list) and all(isinstance(s, Sample) for s in g)
                                                   for g in groups):
            raise TypeError(f"--data-source-path {self.path}: get_samples({num_groups}) must return a list of "
                            f"groups (lists) of Sample, got {type(groups).__name__}")
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.source.add_samples(groups)

    def after_rollout(self, rollout_id: int) -> None:
        """Rollout `rollout_id` was generated: the class saves its state for a resume from it (with --save)."""
        if self.saves and callable(getattr(self.source, "save", None)):
            self.source.save(rollout_id)
            self.saved_at = rollout_id

    def state_dict(self) -> dict:
        return {"slime_data_source_saved_at": self.saved_at}

    def load_state_dict(self, state: dict) -> None:
        rollout_id = state.get("slime_data_source_saved_at")
        if rollout_id is not None and callable(getattr(self.source, "load", None)):
            self.source.load(rollout_id)
            self.saved_at = rollout_id
