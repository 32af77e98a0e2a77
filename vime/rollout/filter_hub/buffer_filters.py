"""Buffer filters: choose which groups leave the rollout buffer (`--buffer-filter-path`).

Contract: `fn(args, buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]`; the function
removes the groups it returns from `buffer` in place.
"""

from __future__ import annotations

from vime.data.sample import Sample


def pop_first(args, buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """Remove and return the oldest `num_groups` groups (fewer if the buffer holds fewer)."""
    if num_groups < 0:
        raise ValueError(f"num_groups must be >= 0, got {num_groups}")
    taken = buffer[:num_groups]
    del buffer[:num_groups]
    return taken
