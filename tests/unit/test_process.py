"""Child processes never outlive their owner: a SIGKILLed owner takes its children's whole trees along."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from vime.utils.process import kill_tree, spawn


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] != "Z"


def test_sigkilled_owner_takes_the_whole_tree(tmp_path):
    pids_file = tmp_path / "pids"
    owner_code = textwrap.dedent(f"""
        import time
        from vime.utils.process import spawn
        # the command starts grandchildren, as vLLM's server starts engine cores and workers
        spawn(["bash", "-c", "sleep 300 & echo $! >> {pids_file}; sleep 300 & echo $! >> {pids_file}; wait"],
              "{tmp_path / 'log'}")
        time.sleep(300)
    """)
    owner = subprocess.Popen([sys.executable, "-c", owner_code])
    deadline = time.monotonic() + 30
    while not (pids_file.exists() and len(pids_file.read_text().split()) == 2):
        assert time.monotonic() < deadline and owner.poll() is None
        time.sleep(0.1)
    grandchildren = [int(p) for p in pids_file.read_text().split()]
    assert all(_alive(p) for p in grandchildren)
    # what Ray does when an actor dies: SIGKILL the worker and its direct children at once
    direct = subprocess.run(["pgrep", "-P", str(owner.pid)], capture_output=True, text=True).stdout.split()
    assert direct
    owner.send_signal(signal.SIGKILL)
    for pid in direct:
        os.kill(int(pid), signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in grandchildren) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in grandchildren), "grandchildren outlived a SIGKILLed owner"


def test_kill_tree_stops_the_group(tmp_path):
    pids_file = tmp_path / "pids"
    proc = spawn(["bash", "-c", f"sleep 300 & echo $! > {pids_file}; wait"], tmp_path / "log")
    deadline = time.monotonic() + 10
    while not (pids_file.exists() and pids_file.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pids_file.read_text())
    kill_tree(proc, grace_s=2)
    assert proc.poll() is not None
    time.sleep(0.2)
    assert not _alive(grandchild)
