"""One run per output directory, and outputs only their owner can read.

A requeued job can start while its predecessor still runs on the same --save: each would delete the other's
partial checkpoints and append to the other's metrics. `RunLock` holds an exclusive lock (flock, released by the
OS when the holder dies, also after SIGKILL) on a file in each of the run's directories; a second run fails at once
naming the holder. The holder (host, pid, start time) is written only once the run is admitted (every directory
locked, the caller's admission check passed): a refused run leaves an earlier run's lock files as it found them.
The directories it creates are 0700; one that exists readable by others gets a warning naming it (the run then also
creates everything under the 077 umask, `private_umask`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

LOCK_NAME = ".vime-run.lock"


class RunInUseError(RuntimeError):
    """Another live run holds the directory."""


def private_umask() -> None:
    """Files and directories this process and its children create are readable by their owner only (rollouts,
    checkpoints, logs and the resolved config can hold prompts, weights and data others must not read)."""
    os.umask(0o077)


def readable_by_others(path: Path) -> bool:
    return bool(stat.S_IMODE(path.stat().st_mode) & (stat.S_IRWXG | stat.S_IRWXO))


class RunLock:
    """`with RunLock([dir, ...]):` the run's directories, created 0700 if missing, each locked for this run.

    `admit`, when given, runs once every directory is locked and may raise to refuse the run (`check_start`)."""

    def __init__(self, directories: list[str | os.PathLike], admit: Callable[[], None] | None = None):
        self.directories = list(dict.fromkeys(Path(d).resolve() for d in directories if d))
        self.admit = admit
        self._held: list[int] = []

    def __enter__(self) -> RunLock:
        try:
            for directory in self.directories:
                self._held.append(self._lock(directory))
            if self.admit is not None:
                self.admit()
            for fd in self._held:  # only now: a refused run must not overwrite the name of the run before it
                _write_holder(fd)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _lock(self, directory: Path) -> int:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if readable_by_others(directory):
            logger.warning("%s can be read by other users (mode %o): the run's outputs in it are private (0700/0600) "
                           "but its listing is not; chmod 700 it", directory, stat.S_IMODE(directory.stat().st_mode))
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunInUseError(f"{directory} is in use by another vime run ({holder}); wait for it to end, stop it, "
                                "or give this run another --output-dir / --save") from None
        return fd

    def __exit__(self, *exc) -> None:
        for fd in self._held:
            os.close(fd)  # closing releases the lock
        self._held = []


def _write_holder(fd: int) -> None:
    """Name this run in a lock file it holds, for the error a second run gets."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
