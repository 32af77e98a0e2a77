"""metrics.jsonl across runs: a resumed run (or one told --overwrite-output) drops the rows of the rollouts it
does again, keeps the earlier ones, and appends after them."""

from __future__ import annotations

import json

from vime.utils.logging_utils import MetricsLogger


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_from_the_resumed_rollout_on_are_replaced(tmp_path):
    first = MetricsLogger(str(tmp_path))
    for r in range(4):
        first.log(r, {"rollout/reward_mean": r / 10})
    first.jsonl.close()
    second = MetricsLogger(str(tmp_path))
    assert second.drop_rows_from(2) == 2 and second.drop_rows_from(2) == 0
    second.log(2, {"rollout/reward_mean": 0.9})
    second.jsonl.close()
    assert [(r["rollout_id"], r["rollout/reward_mean"]) for r in _rows(tmp_path / "metrics.jsonl")] == [
        (0, 0.0), (1, 0.1), (2, 0.9)]
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a run killed mid-write leaves half a row
        f.write('{"rollout_id": 3, "rollout/rew')
    resumed = MetricsLogger(str(tmp_path))
    assert resumed.drop_rows_from(3) == 1 and len(_rows(tmp_path / "metrics.jsonl")) == 3
    resumed.jsonl.close()
    third = MetricsLogger(str(tmp_path))
    assert third.drop_rows_from(0) == 3 and _rows(tmp_path / "metrics.jsonl") == []  # --overwrite-output
