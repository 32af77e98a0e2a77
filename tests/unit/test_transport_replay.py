"""Crash replay bookkeeping: which stored rollouts a resumed run replays, and the trained-samples record."""

from __future__ import annotations

from vime.transport.rollouts import rollout_summary
from vime.transport.rollouts.replay import (TRAINED_SAMPLES, append_trained_samples, read_trained_samples, replay_ids,
                                        truncate_trained_samples)


def test_replay_ids_are_the_unbroken_run_from_start():
    assert replay_ids({0, 1, 2, 3, 5}, 2) == [2, 3]  # 0, 1 are in the checkpoint; 5 comes after a gap
    assert replay_ids({4}, 2) == []
    assert replay_ids(set(), 0) == []


def _groups(ids):
    return [[{"index": i} for i in ids[:2]], [{"index": i} for i in ids[2:]]]


def _ids(groups):  # what the driver keeps of a rollout (vime.transport.rollouts.rollout_summary)
    return rollout_summary(groups)["sample_ids"]


def test_trained_samples_are_cut_back_to_the_checkpoint_on_resume(tmp_path):
    for rollout_id in range(4):
        append_trained_samples(tmp_path, rollout_id, _ids(_groups([4 * rollout_id + j for j in range(4)])), False)
    with open(tmp_path / TRAINED_SAMPLES, "a") as f:
        f.write('{"rollout_id": 4, "sample_')  # killed mid-write
    truncate_trained_samples(tmp_path, start=2)  # resumed from the checkpoint of rollout 1
    records = read_trained_samples(tmp_path)
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert [i for r in records for i in r["sample_ids"]] == list(range(8))
    append_trained_samples(tmp_path, 2, _ids(_groups([8, 9, 10, 11])), replayed=True)
    assert read_trained_samples(tmp_path)[-1] == {"rollout_id": 2, "sample_ids": [8, 9, 10, 11], "replayed": True}


def test_truncate_without_a_record_is_a_no_op(tmp_path):
    truncate_trained_samples(tmp_path, 0)
    assert read_trained_samples(tmp_path) == []
