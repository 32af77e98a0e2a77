"""One run per output directory (`RunLock`) and private outputs: a second run on a held directory fails at once
naming the holder, also through train.py before Ray starts; the lock goes with its holder, even a SIGKILLed one;
directories are created 0700 and files under the run's umask 0600; a directory others can read is reported."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vime.utils.run_lock import LOCK_NAME, RunInUseError, RunLock

REPO = Path(__file__).resolve().parents[2]
HOLDER = textwrap.dedent('''
    import sys, time
    from vime.utils.run_lock import RunLock
    with RunLock([sys.argv[1]]):
        print("held", flush=True)
        time.sleep(600)
''')


@pytest.fixture()
def held(tmp_path):
    """A directory locked by another live process; yields (directory, that process)."""
    directory = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    yield directory, proc
    proc.kill()
    proc.wait()


def test_a_second_run_fails_naming_the_holder(held):
    directory, proc = held
    with pytest.raises(RunInUseError, match=rf"in use by another vime run .*\"pid\": {proc.pid}"):
        with RunLock([directory]):
            pass
    proc.send_signal(signal.SIGKILL)  # the holder dies without cleaning up: its lock goes with it
    proc.wait()
    with RunLock([directory]):
        assert f'"pid": {os.getpid()}' in (directory / LOCK_NAME).read_text()


def test_train_py_refuses_a_held_output_dir_before_starting(held, tiny_qwen3, arithmetic_data):
    directory, proc = held
    start = time.monotonic()
    run = subprocess.run([sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3), "--prompt-data",
                          str(arithmetic_data[0]), "--rm-type", "math", "--num-rollout", "1", "--output-dir",
                          str(directory)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 1, run.stderr[-3000:]
    assert f"{directory} is in use by another vime run" in run.stderr and f'"pid": {proc.pid}' in run.stderr
    assert "Ray" not in run.stderr and time.monotonic() - start < 30


def test_directories_are_private(tmp_path, caplog):
    new = tmp_path / "new" / "run"
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="vime.utils.run_lock"), RunLock([new, shared, new]):
        assert stat.S_IMODE(new.stat().st_mode) == 0o700
        assert stat.S_IMODE((new / LOCK_NAME).stat().st_mode) == 0o600
    assert [r.getMessage() for r in caplog.records if str(new) in r.getMessage()] == []
    assert any(f"{shared} can be read by other users (mode 755)" in r.getMessage() for r in caplog.records)


def test_private_umask_in_a_child():
    code = ("import os\nfrom vime.utils.run_lock import private_umask\nprivate_umask()\n"
            "open('f', 'w').close(); os.mkdir('d')\n"
            "print(oct(os.stat('f').st_mode & 0o777), oct(os.stat('d').st_mode & 0o777))")
    import tempfile

    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert out.stdout.split() == ["0o600", "0o700"], out.stderr


EARLIER_HOLDER = '{"host": "node-1", "pid": 4242, "started": "2026-01-01 00:00:00"}'


def _earlier_runs_directory(path: Path) -> Path:
    """A directory an earlier run used and left (its lock file still naming it)."""
    path.mkdir(mode=0o700)
    (path / LOCK_NAME).write_text(EARLIER_HOLDER)
    return path


def test_a_refused_run_leaves_the_earlier_runs_lock_file_as_it_was(held, tmp_path):
    """Refused by a held directory after locking a free one, or by its admission check: the lock file of the
    directory it did lock still names the run before it."""
    earlier = _earlier_runs_directory(tmp_path / "earlier")
    with pytest.raises(RunInUseError):
        with RunLock([earlier, held[0]]):
            pass
    assert (earlier / LOCK_NAME).read_text() == EARLIER_HOLDER

    def refuse():
        raise ValueError("this run's directories hold an earlier run's state")

    with pytest.raises(ValueError, match="earlier run's state"):
        with RunLock([earlier], admit=refuse):
            pass
    assert (earlier / LOCK_NAME).read_text() == EARLIER_HOLDER
    with RunLock([earlier], admit=lambda: None):  # admitted: now it names this run
        assert f'"pid": {os.getpid()}' in (earlier / LOCK_NAME).read_text()


def test_train_py_refused_over_an_earlier_runs_state_leaves_its_lock_file(tmp_path, tiny_qwen3, arithmetic_data):
    earlier = _earlier_runs_directory(tmp_path / "out")
    (earlier / "trained_samples.jsonl").write_text('{"rollout_id": 3, "sample_ids": [1]}\n')
    run = subprocess.run([sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3), "--prompt-data",
                          str(arithmetic_data[0]), "--rm-type", "math", "--num-rollout", "1", "--output-dir",
                          str(earlier)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 1 and "earlier run's state" in run.stderr, run.stderr[-3000:]
    assert (earlier / LOCK_NAME).read_text() == EARLIER_HOLDER
