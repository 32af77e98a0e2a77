"""Child processes that never outlive their owner.

Engines and the router are separate OS processes. Each is started in its own session (so the whole tree can be
signalled at once) and with PR_SET_PDEATHSIG, so that if the owning process dies, even by SIGKILL, the kernel
kills the child too; vLLM's own workers exit when their parent server does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: rely on explicit stop()
        pass


def spawn(cmd: list[str], log_path: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` with stdout+stderr to `log_path`, in a new session, killed if this process dies."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, preexec_fn=_die_with_parent)
    finally:
        log.close()


def kill_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `grace_s`."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # reap stragglers of an already dead leader
        return
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: str | Path, n_bytes: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def wait_until(predicate, timeout_s: float, interval_s: float = 0.5, alive=None) -> bool:
    """Poll `predicate` until true or timeout; stop early (False) when `alive()` turns false."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if alive is not None and not alive():
            return False
        time.sleep(interval_s)
    return False
