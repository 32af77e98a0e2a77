"""Writing generated task rows as train/eval JSONL files, with no prompt in two rows (train and eval never share)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable


def write_distinct_splits(out: str | Path, make_row: Callable[[random.Random], dict[str, Any]],
                          sizes: dict[str, int], seed: int = 0, max_tries: int = 100) -> list[Path]:
    """Draw rows with `make_row(rng)` until each split (e.g. {"train": 512, "eval": 64}) has its size of rows
    with distinct prompts; writes OUT/<split>.jsonl and returns the paths in the order of `sizes`. Raises when
    the generator runs dry (more than `max_tries` draws per row wanted) instead of looping forever."""
    out, rng, seen, paths = Path(out), random.Random(seed), set(), []
    out.mkdir(parents=True, exist_ok=True)
    budget = max_tries * sum(sizes.values())
    for name, n in sizes.items():
        rows = []
        while len(rows) < n:
            if budget == 0:
                raise ValueError(f"could not draw {sum(sizes.values())} rows with distinct prompts: the task space "
                                 f"is smaller than that; ask for fewer rows")
            budget -= 1
            row = make_row(rng)
            key = json.dumps(row["prompt"], sort_keys=True)
            if key not in seen:
                seen.add(key)
                rows.append(row)
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths
