"""Saved rollouts: one `Sample.to_dict()` JSON object per line, readable by people and by
`--load-debug-rollout-data`."""

from __future__ import annotations

import json
from pathlib import Path

from vime.data.sample_codec import json_ready
from vime.utils.types import Sample


def rollout_path(template: str, rollout_id: int) -> Path:
    return Path(template.format(rollout_id=rollout_id))


def save_rollout(template: str, rollout_id: int, groups: list[list[Sample]]) -> Path:
    path = rollout_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for group in groups:
            for sample in group:
                f.write(json.dumps(json_ready(sample.to_dict()), ensure_ascii=False) + "\n")
    tmp.replace(path)  # readers never see a half-written file
    return path


def load_rollout(template: str, rollout_id: int) -> list[list[Sample]]:
    """Read a saved rollout back into groups (consecutive samples with the same group_index)."""
    path = rollout_path(template, rollout_id)
    if not path.is_file():
        raise FileNotFoundError(f"--load-debug-rollout-data: {path} does not exist (rollout {rollout_id})")
    groups: list[list[Sample]] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                sample = Sample.from_dict(json.loads(line))
            except (json.JSONDecodeError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a saved Sample: {e}") from None
            if groups and groups[-1][0].group_index == sample.group_index:
                groups[-1].append(sample)
            else:
                groups.append([sample])
    return groups
