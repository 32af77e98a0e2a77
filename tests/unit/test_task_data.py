"""Generated example data: splits never share a prompt, and a too-small task space is an error, not a hang."""

from __future__ import annotations

import json

import pytest

from vime.synthetic.task_data import write_distinct_splits


def _row(rng):
    return {"prompt": f"what is {rng.randint(0, 9)} + 1?", "label": "?"}


def test_splits_are_distinct_and_sized(tmp_path):
    train, evaluation = write_distinct_splits(tmp_path, _row, {"train": 7, "eval": 3}, seed=1)
    prompts = [json.loads(line)["prompt"] for p in (train, evaluation) for line in p.read_text().splitlines()]
    assert len(prompts) == 10 and len(set(prompts)) == 10  # all ten possible prompts, once each


def test_too_small_task_space_raises(tmp_path):
    with pytest.raises(ValueError, match="task space is smaller"):
        write_distinct_splits(tmp_path, _row, {"train": 8, "eval": 3})
