"""Publishing a checkpoint (`checkpoint_files`): what a resume starts from after a crash at any point of a save,
an unreadable marker, retention. Files only; the real trainer's save, kill and resume is in test_trainer.py."""

from __future__ import annotations

import json
import logging

import pytest

from vime.trainer.megatron import checkpoint_files as cf


def _save(root, rollout_id, parts=("actor",)):
    """What the trainers' save leaves: an unpublished iteration with each part's files and state."""
    partial = cf.fresh_partial(str(root), rollout_id)
    for role in parts:
        part = cf.part_dir(partial, role)
        part.mkdir(exist_ok=True)
        (part / "weights.bin").write_bytes(bytes([rollout_id]) * 8)
        (part / cf.STATE_FILE).write_text(json.dumps({"rollout_id": rollout_id}))
    return partial


def test_a_checkpoint_counts_only_once_published(tmp_path):
    _save(tmp_path, 1)
    assert cf.resolve_checkpoint(str(tmp_path)) is None  # saved but not published: a crash here resumes nothing
    cf.publish(str(tmp_path), 1)
    assert cf.resolve_checkpoint(str(tmp_path)) == tmp_path / "iter_0000001"
    assert (tmp_path / cf.MARKER_FILE).read_text() == "1"
    partial = _save(tmp_path, 2)
    (partial / cf.STATE_FILE).unlink()  # killed inside the model save: the part never got its state file
    with pytest.raises(RuntimeError, match="not a finished save"):
        cf.publish(str(tmp_path), 2)
    assert cf.resolve_checkpoint(str(tmp_path)) == tmp_path / "iter_0000001"
    _save(tmp_path, 2)  # the next run's save starts from a fresh directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000002.partial", cf.MARKER_FILE]


def test_the_marker_covers_actor_and_critic(tmp_path):
    _save(tmp_path, 1, parts=("actor", "critic"))
    cf.publish(str(tmp_path), 1, parts=["actor", "critic"])
    _save(tmp_path, 2, parts=("actor",))  # killed between the actor's save and the critic's
    with pytest.raises(RuntimeError, match="critic's part"):
        cf.publish(str(tmp_path), 2, parts=["actor", "critic"])
    resumed = cf.resolve_checkpoint(str(tmp_path))
    assert resumed == tmp_path / "iter_0000001" and (cf.part_dir(resumed, "critic") / cf.STATE_FILE).is_file()


@pytest.mark.parametrize("marker", ["", "1\x00\x00", "iter_1", "99"])
def test_an_unreadable_marker_is_ignored_with_a_warning(tmp_path, caplog, marker):
    for i in (1, 2):
        _save(tmp_path, i)
        cf.publish(str(tmp_path), i)
    _save(tmp_path, 3)  # unpublished: never chosen
    (tmp_path / cf.MARKER_FILE).write_text(marker)
    with caplog.at_level(logging.WARNING):
        assert cf.resolve_checkpoint(str(tmp_path)) == tmp_path / "iter_0000002"
    assert "checkpoint marker" in caplog.text or "newest complete" in caplog.text


def test_the_marked_checkpoint_is_never_overwritten_or_pruned(tmp_path):
    for i in range(1, 5):
        _save(tmp_path, i)
        cf.publish(str(tmp_path), i, retain=2)
    assert cf.complete_iterations(str(tmp_path)) == [3, 4]
    _save(tmp_path, 4)
    with pytest.raises(RuntimeError, match="would replace it"):
        cf.publish(str(tmp_path), 4)
    assert (tmp_path / "iter_0000004" / "weights.bin").read_bytes() == bytes([4]) * 8
    cf.write_marker(str(tmp_path), "3")  # e.g. a resume from 3 whose old 4 was published by a crashed run
    assert cf.prune(str(tmp_path), 1) == [] and cf.complete_iterations(str(tmp_path)) == [3, 4]
    cf.publish(str(tmp_path), 4)  # the stale 4 is replaced, with a warning
    assert cf.read_marker(str(tmp_path)) == "4" and not list(tmp_path.glob("*.replaced-*"))


def test_release_checkpoints_resolve(tmp_path):
    (tmp_path / "release").mkdir()
    cf.write_marker(str(tmp_path), "release")
    assert cf.resolve_checkpoint(str(tmp_path)) == tmp_path / "release"
