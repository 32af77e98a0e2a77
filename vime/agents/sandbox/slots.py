"""Uids for sandboxes when vime runs as root: one unprivileged uid of its own per running sandbox (a slot).

    pool = UidPool(base=DEFAULT_UID_BASE, count=256)
    slot = await pool.acquire()  # a uid no other sandbox on this machine holds now, emptied of processes
    ... run the program as slot.uid ...
    await pool.release(slot)     # every process of slot.uid killed, then the slot is free again

Why: RLIMIT_NPROC counts processes per uid, so sandboxes sharing one uid share one limit (one fork bomb fails
its neighbours), may signal each other and read each other's files. With a uid per slot the limit is per
sandbox, and "kill every process of this uid" finds every descendant of a run, `setsid` or not.
Slots are claimed with flock(2) on files in a directory only root may write, so LocalSandboxes in several
processes of one machine never hold the same uid at once. The uids must belong to no account (checked).
"""

from __future__ import annotations

import asyncio
import fcntl
import grp
import os
import pwd
import signal
import stat
import sys
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_UID_BASE = 2**30  # far above login uids and the usual subordinate-uid ranges (100000 + 65536 * n)
DEFAULT_SLOTS = 256


@dataclass
class Slot:
    uid: int
    gid: int
    fd: int  # holds the flock


@lru_cache(maxsize=None)
def check_unused_ids(base: int, count: int) -> None:
    """Refuse uids/gids that belong to an account: killing "every process of the uid" would hit its processes."""
    if base <= 0 or count <= 0 or base + count > 2**32 - 2:
        raise ValueError(f"sandbox uid range {base}..{base + count - 1} is not a range of unprivileged uids")
    for n in range(base, base + count):
        for lookup, kind in ((pwd.getpwuid, "user"), (grp.getgrgid, "group")):
            try:
                entry = lookup(n)
            except KeyError:
                continue
            raise ValueError(f"sandbox uid {n} belongs to {kind} {entry[0]!r}; choose another range with "
                             f"LocalSandbox(uid_base=...) (default {DEFAULT_UID_BASE})")


def uid_processes(uid: int) -> list[int]:
    """Pids of processes whose real, effective or saved uid is `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if uid in (int(x) for x in line.split()[1:4]):
                                pids.append(int(entry.name))
                            break
            except (OSError, ValueError):
                continue
    return pids


def _kill_as(uid: int, gid: int) -> str:
    """A program that drops to `uid` and sends SIGKILL to every process it may signal: exactly that uid's."""
    return (f"import os\nos.setgroups([])\nos.setgid({int(gid)})\nos.setuid({int(uid)})\n"
            f"try:\n    os.kill(-1, {int(signal.SIGKILL)})\nexcept OSError:\n    pass")


async def kill_uid(uid: int, gid: int) -> None:
    """SIGKILL every process of `uid`: kill(-1) sent *as* that uid reaches exactly its processes, atomically
    with respect to fork (a process cannot slip out between listing and killing). This interpreter starts as
    root and drops to the uid itself: the uid may not be able to reach it (a venv under /root or /home)."""
    for _ in range(3):
        if not uid_processes(uid):
            return
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-S", "-c", _kill_as(uid, gid), env={}, cwd="/", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        await proc.wait()
        await asyncio.sleep(0.01)  # SIGKILL is delivered asynchronously; exiting takes a moment


def _lock_dir() -> str:
    """A directory only this (root) user may write: a sandbox must not be able to hold or fake a slot's lock.
    A fixed path, not $TMPDIR: every process on the machine must find the same locks."""
    path = f"/tmp/vime-sandbox-slots-{os.geteuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{path} must be a directory owned by uid {os.geteuid()} that no one else may write; "
                           "remove it and retry")
    return path


class UidPool:
    """Slots base..base+count-1; gid = uid. Claimed across processes with flock, within one with the same."""

    def __init__(self, base: int = DEFAULT_UID_BASE, count: int = DEFAULT_SLOTS):
        check_unused_ids(base, count)
        self.base, self.count = base, count
        self.dir = _lock_dir()
        self._next = 0

    def _try(self, uid: int) -> Slot | None:
        fd = os.open(os.path.join(self.dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return Slot(uid=uid, gid=uid, fd=fd)

    async def acquire(self, poll_s: float = 0.05) -> Slot:
        """A free slot, waiting while all are taken; its uid is emptied of leftovers (a crashed earlier run)."""
        while True:
            for i in range(self.count):
                uid = self.base + (self._next + i) % self.count
                slot = self._try(uid)
                if slot is not None:
                    self._next = (uid - self.base + 1) % self.count
                    await kill_uid(slot.uid, slot.gid)
                    return slot
            await asyncio.sleep(poll_s)

    async def release(self, slot: Slot) -> None:
        try:
            await kill_uid(slot.uid, slot.gid)
        finally:
            os.close(slot.fd)  # closing the last descriptor drops the flock
