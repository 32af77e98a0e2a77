"""The straw transport after a crash between taking a straw owner and writing the index (or, in trim, between
unlinking the index and releasing the owner): the next start releases the orphaned owner and its pack is
collected, while indexed rollouts stay readable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import vime.transport.rollouts.straw_store as straw_store
from tests.unit.test_transport import _groups, _pack_files
from vime.transport.rollouts.straw_store import StrawTransport

REPO = Path(__file__).resolve().parents[2]


def _owners(transport: StrawTransport) -> int:
    """How many owners straw holds (it cannot list them; its GC reports the count)."""
    return transport.store.collect_garbage()["owners"]


def _assert_only_rollout_0_remains(root: Path) -> None:
    restarted = StrawTransport(root)  # a new run on the same directory
    stored = restarted.stored()
    assert sorted(stored) == [0]
    assert len(_pack_files(root)) == 1, "the orphan's pack was not collected"
    assert _owners(restarted) == 1
    assert restarted.get(stored[0]) == (_groups(0), {})
    assert not list((root / "pending").iterdir())
    restarted.close()


def test_an_owner_orphaned_by_a_failed_index_write_is_released_at_restart(tmp_path, monkeypatch):
    t = StrawTransport(tmp_path)
    t.put(0, _groups(0), {})

    def failing_write(path, data, sync_dir=True):
        if path.parent.name == "index":
            raise OSError("disk full")
        return real_write(path, data, sync_dir)

    real_write = straw_store._write_atomically
    monkeypatch.setattr(straw_store, "_write_atomically", failing_write)
    with pytest.raises(OSError, match="disk full"):
        t.put(1, _groups(1), {})
    assert len(_pack_files(tmp_path)) == 2 and _owners(t) == 2  # rollout 1 is retained but not indexed
    t.close()
    monkeypatch.undo()
    _assert_only_rollout_0_remains(tmp_path)


def test_an_owner_orphaned_by_a_kill_before_the_index_write_is_released_at_restart(tmp_path):
    code = (f"import os, sys; sys.path.insert(0, {str(REPO)!r})\n"
            "import vime.transport.rollouts.straw_store as s\n"
            "from tests.unit.test_transport import _groups\n"
            f"t = s.StrawTransport({str(tmp_path)!r})\n"
            "t.put(0, _groups(0), {})\n"
            "real = s._write_atomically\n"
            "s._write_atomically = lambda p, *a, **k: os._exit(9) if p.parent.name == 'index' else real(p, *a, **k)\n"
            "t.put(1, _groups(1), {})\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert len(_pack_files(tmp_path)) == 2  # the killed put's pack, owned by nobody the index knows
    _assert_only_rollout_0_remains(tmp_path)


def test_an_owner_left_by_a_trim_cut_short_is_released_at_restart(tmp_path, monkeypatch):
    t = StrawTransport(tmp_path)
    for i in range(2):
        t.put(i, _groups(i), {})
    def killed(self, owner):
        raise OSError("killed")

    monkeypatch.setattr(type(t.store), "release", killed)
    with pytest.raises(OSError, match="killed"):
        t.trim([1])
    monkeypatch.undo()
    assert len(_pack_files(tmp_path)) == 2 and _owners(t) == 2  # unindexed, still owned
    t.close()
    _assert_only_rollout_0_remains(tmp_path)


def test_a_clean_run_leaves_nothing_pending(tmp_path):
    t = StrawTransport(tmp_path)
    for i in range(3):
        t.put(i, _groups(i), {})
    t.trim([1, 2])
    assert not list((tmp_path / "pending").iterdir())
    assert sorted(StrawTransport(tmp_path).stored()) == [0] and _owners(t) == 1
    t.close()
