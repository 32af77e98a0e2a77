"""A full disk while a rollout's copy is saved (<output-dir>/rollouts, --save-debug-rollout-data) loses the copy,
never the rollout: the rollout manager logs it, counts it in the rollout's metrics and hands the rollout to training;
the writers leave no half-written .tmp behind (it would hold the space that ran out). ENOSPC is simulated."""

from __future__ import annotations

import errno
import logging
import os
from types import SimpleNamespace

import pytest

from vime.data.sample import Sample
from vime.data.saved_rollouts import write_gzip_lines
from vime.rollout.context import RolloutContext
import vime.rollout.debug_data as debug_data
from vime.rollout_manager.engine_health import FailedRollouts
from vime.rollout_manager.manager import RolloutManager
import vime.rollout_manager.manager as rollout_manager


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _rows_until_the_disk_fills():
    yield {"a": 1}
    _disk_full()


def test_write_gzip_lines_removes_its_tmp_when_the_disk_fills(tmp_path):
    path = tmp_path / "rollouts" / "rollout_0.jsonl.gz"
    with pytest.raises(OSError) as e:
        write_gzip_lines(path, _rows_until_the_disk_fills())
    assert e.value.errno == errno.ENOSPC
    assert list(path.parent.iterdir()) == []  # neither the file nor its .tmp


def test_save_rollout_removes_its_tmp_when_the_disk_fills(tmp_path, monkeypatch):
    written = []

    def ready_until_full(value):
        if written:
            _disk_full()
        written.append(value)
        return value

    monkeypatch.setattr(debug_data, "json_ready", ready_until_full)
    with pytest.raises(OSError):
        debug_data.save_rollout(str(tmp_path / "debug_{rollout_id}.jsonl"), 3, [[Sample(index=0), Sample(index=1)]])
    assert written and list(tmp_path.iterdir()) == []


class _Transport:
    def __init__(self):
        self.calls = []

    def put(self, rollout_id, dicts, extra):
        self.calls.append((rollout_id, len(dicts)))
        return f"handle-{rollout_id}"


def _manager(tmp_path, groups):
    """The rollout manager's own `generate`, `eval` and `_keep_for_inspection` around stand-ins for the fleet,
    the data and the transport, saving both copies under `tmp_path`."""
    cls = RolloutManager.__ray_actor_class__
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), save_rollouts=True, save_rollouts_max_mb=16.0,
                           save_debug_rollout_data=str(tmp_path / "debug" / "rollout_{rollout_id}.jsonl"))
    manager = SimpleNamespace(
        args=args, plugin_args=args, data_source=None, context=RolloutContext(),
        fleet=SimpleNamespace(recovery=SimpleNamespace(reconcile_router=lambda: None, check_soon=lambda: None),
                              spec_counters=lambda: None),
        rollout_fn=lambda _args, _rollout_id, _source: groups, failures=FailedRollouts(0.5, 3),
        eval_fn=lambda _args, _rollout_id, _sources, evaluation: {"math": groups[0]}, eval_sources={"math": None},
        transport=_Transport(), data_source_state=lambda: None,
        hooks={"convert": None, "log_rollout": None, "log_eval": None})
    manager._judge = lambda rollout_id, metrics: cls._judge(manager, rollout_id, metrics)
    manager._keep_for_inspection = lambda name, saved: cls._keep_for_inspection(manager, name, saved)
    return manager, cls


def _groups():
    return [[Sample(index=i, group_index=0, response="r", response_length=1, reward=1.0) for i in range(2)]]


def test_a_full_disk_loses_the_rollouts_copies_not_the_rollout(tmp_path, monkeypatch, caplog):
    manager, cls = _manager(tmp_path, _groups())
    monkeypatch.setattr(debug_data, "write_gzip_lines", _disk_full)  # <output-dir>/rollouts
    monkeypatch.setattr(rollout_manager, "save_rollout", _disk_full)  # --save-debug-rollout-data
    with caplog.at_level(logging.ERROR, logger=rollout_manager.__name__):
        ref = cls.generate(manager, 7)
    assert manager.transport.calls == [(7, 1)] and ref.handle == "handle-7"  # handed to training all the same
    assert ref.extra["metrics"]["rollout/save_errors"] == 2.0 and "skip_reason" not in ref.extra
    assert "could not save rollout 7 to <output-dir>/rollouts" in caplog.text
    assert "could not save rollout 7 to --save-debug-rollout-data" in caplog.text
    assert "No space left on device" in caplog.text and "--no-save-rollouts" in caplog.text

    metrics = cls.eval(manager, 7)
    assert metrics["eval/math/save_errors"] == 2.0 and metrics["eval/math/num_samples"] == 2.0
    assert "could not save eval 'math' at rollout 7" in caplog.text


def test_saved_copies_count_no_errors(tmp_path):
    manager, cls = _manager(tmp_path, _groups())
    ref = cls.generate(manager, 0)
    assert "rollout/save_errors" not in ref.extra["metrics"]
    assert (tmp_path / "run" / "rollouts" / "rollout_0.jsonl.gz").is_file()
    assert (tmp_path / "debug" / "rollout_0.jsonl").is_file()
