"""A run refuses to start over an earlier run's state unless it resumes it or is told to start over
(`vime.driver.previous_run`), and leaves every file as it found it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vime.driver.previous_run import check_start
from vime.trainer.megatron import checkpoint_files as cf


def _args(tmp_path, **kw):
    base = dict(load=None, save=None, output_dir=str(tmp_path / "out"), rollout_data_dir=str(tmp_path / "data"),
                overwrite_output=False)
    return SimpleNamespace(**{**base, **kw})


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _earlier_run(tmp_path):
    save = tmp_path / "ckpt"
    part = cf.fresh_partial(str(save), 3)
    (part / cf.STATE_FILE).write_text(json.dumps({"rollout_id": 3}))
    cf.publish(str(save), 3)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "trained_samples.jsonl").write_text('{"rollout_id": 3, "sample_ids": [1]}\n')
    return save


def test_a_fresh_run_over_earlier_state_refuses_and_touches_nothing(tmp_path):
    save = _earlier_run(tmp_path)
    before = _snapshot(tmp_path)
    for args, stored in ((_args(tmp_path, save=str(save)), 0), (_args(tmp_path), 0), (_args(tmp_path), 2)):
        with pytest.raises(ValueError, match="--overwrite-output") as refused:
            check_start(args, stored)
        assert "earlier run's state" in str(refused.value)
    assert "checkpoints in --save" in str(pytest.raises(ValueError, check_start, _args(tmp_path, save=str(save)), 0)
                                          .value)
    assert "2 stored rollouts" in str(pytest.raises(ValueError, check_start, _args(tmp_path), 2).value)
    assert _snapshot(tmp_path) == before
    check_start(_args(tmp_path, save=str(save), overwrite_output=True), 2)  # told to start over
    check_start(_args(tmp_path, save=str(save), load=str(save)), 2)  # resuming it
    check_start(_args(tmp_path / "elsewhere"), 0)  # nothing there
    assert _snapshot(tmp_path) == before


def test_load_of_a_directory_without_a_checkpoint_is_an_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"--load {empty}: no checkpoint"):
        check_start(_args(tmp_path, load=str(empty)), 0)
    cf.fresh_partial(str(empty), 1)  # an unpublished save is not a checkpoint either
    with pytest.raises(ValueError, match="no checkpoint"):
        check_start(_args(tmp_path, load=str(empty), overwrite_output=True), 0)
    # the resume idiom of Megatron-LM / slime scripts: --load and --save the same, empty on the first run
    check_start(_args(tmp_path, load=str(tmp_path / "new"), save=str(tmp_path / "new")), 0)
