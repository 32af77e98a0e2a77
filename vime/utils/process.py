"""Child processes that never outlive their owner.

Engines and the router are separate OS processes. Each is started in its own session (so the whole tree can be
signalled at once) under `vime.utils.watchdog`, which SIGKILLs that session's process group as soon as the owner
is gone, even after a SIGKILL of the owner; that also reaches the engine-core and worker processes vLLM starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _new_session() -> None:
    os.setsid()


def spawn(cmd: list[str], log_path: str | Path, env: dict[str, str] | None = None,
          stdin_data: bytes | None = None) -> subprocess.Popen:
    """Start `cmd` with stdout+stderr to `log_path`, in a new session, killed if this process dies. `stdin_data`:
    what the command reads on its standard input (then closed), for anything secret: every user on the node can
    read a process's argv."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    try:
        watched = [sys.executable, "-m", "vime.utils.watchdog", str(os.getpid()), "--", *cmd]
        proc = subprocess.Popen(watched, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL if stdin_data is None else subprocess.PIPE,
                                env=env, preexec_fn=_new_session)
    finally:
        log.close()
    if stdin_data is not None:
        with proc.stdin:
            proc.stdin.write(stdin_data)
    return proc


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


# a server on a port vime chose (an engine, the router): launches on fresh ports when another process binds the
# chosen one first
PORT_ATTEMPTS = 3


def lost_port_race(proc, log_path: Path, log_offset: int) -> bool:
    """Whether the server exited because its port was taken between choosing and binding it (its log from
    `log_offset`, where this launch's output begins, says so)."""
    if proc.poll() is None:
        return False
    with open(log_path, "rb") as f:
        f.seek(log_offset)
        return b"Address already in use" in f.read()
