"""cgroup v2 limits for LocalSandbox: memory.max and pids.max over a whole sandbox, and cgroup.kill at its end.

    pool = cgroup_pool()            # None when this machine does not allow it; cgroup_reason() says why
    path = pool.start_run("run-1", memory_bytes=2**30, pids=32)
    ... the jail writes itself into path/cgroup.procs before it forks anything ...
    await pool.end_run(path)        # kills whatever is left (cgroup.kill), removes the cgroup

Needs cgroup v2 with the memory and pids controllers, and a cgroup this process may create children in and
enable those controllers for: by default its own cgroup, or `VIME_SANDBOX_CGROUP` (a delegated, empty cgroup,
e.g. `mkdir /sys/fs/cgroup/vime && echo '+memory +pids' > /sys/fs/cgroup/cgroup.subtree_control`). A cgroup that
holds processes cannot enable controllers for its children (cgroup v2's no-internal-processes rule), so inside
most containers this is unavailable unless one is delegated; rlimits still apply per process then.
"""

from __future__ import annotations

import asyncio
import atexit
import errno
import os
import signal
from functools import lru_cache

_CONTROLLERS = ("memory", "pids")


class CgroupUnavailable(Exception):
    """Why no sandbox cgroups can be made here (the message goes into the isolation report)."""


def own_cgroup_dir(mountinfo: str, proc_cgroup: str) -> str:
    """This process's cgroup v2 directory, from the texts of /proc/self/mountinfo and /proc/self/cgroup."""
    mounts = [line.split() for line in mountinfo.splitlines()]
    v2 = [m for m in mounts if "-" in m and m[m.index("-") + 1] == "cgroup2"]
    if not v2:
        raise CgroupUnavailable("no cgroup v2 file system is mounted")
    own = next((line[3:] for line in proc_cgroup.splitlines() if line.startswith("0::")), None)
    if own is None:
        raise CgroupUnavailable("this process is in no cgroup v2 (cgroup v1 only)")
    for m in v2:
        root, mount_point = m[3], m[4]
        if own == root or own.startswith(root.rstrip("/") + "/") or root == "/":
            rel = own[len(root.rstrip("/")):] if root != "/" else own
            return os.path.normpath(os.path.join(mount_point, rel.lstrip("/")))
    raise CgroupUnavailable(f"this process's cgroup {own} is not under a mounted cgroup v2 tree")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class CgroupPool:
    """A cgroup of this process's sandboxes (`<parent>/vime-sandbox-<pid>`), one child cgroup per run."""

    def __init__(self, parent: str, name: str | None = None):
        self.parent = parent
        self.dir = os.path.join(parent, name or f"vime-sandbox-{os.getpid()}")
        controllers = _read(os.path.join(parent, "cgroup.controllers")).split()
        missing = [c for c in _CONTROLLERS if c not in controllers]
        if missing:
            raise CgroupUnavailable(f"{parent} offers no {'/'.join(missing)} controller (cgroup.controllers: "
                                    f"{' '.join(controllers) or 'none'}; bound to cgroup v1 here?)")
        try:
            self._enable(parent)
            os.makedirs(self.dir, exist_ok=True)
            self._enable(self.dir)
        except OSError as e:
            hint = " (it holds processes: delegate an empty cgroup with VIME_SANDBOX_CGROUP)" \
                if e.errno == errno.EBUSY else ""
            raise CgroupUnavailable(f"cannot enable memory/pids for children of {parent}: {e.strerror}{hint}") from e

    @staticmethod
    def _enable(path: str) -> None:
        enabled = _read(os.path.join(path, "cgroup.subtree_control")).split()
        wanted = [c for c in _CONTROLLERS if c not in enabled]
        if wanted:
            _write(os.path.join(path, "cgroup.subtree_control"), " ".join("+" + c for c in wanted))

    def start_run(self, name: str, memory_bytes: int, pids: int) -> str:
        path = os.path.join(self.dir, name)
        os.mkdir(path)
        _write(os.path.join(path, "memory.max"), str(memory_bytes))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            _write(os.path.join(path, "memory.swap.max"), "0")
        _write(os.path.join(path, "pids.max"), str(pids))
        return path

    @staticmethod
    def oom_killed(path: str) -> bool:
        try:
            events = dict(line.split() for line in _read(os.path.join(path, "memory.events")).splitlines())
        except (OSError, ValueError):
            return False
        return int(events.get("oom_kill", 0)) > 0

    @staticmethod
    def kill(path: str) -> None:
        """Every process in the cgroup, at once where the kernel has cgroup.kill (5.14), else one by one."""
        if os.path.exists(os.path.join(path, "cgroup.kill")):
            _write(os.path.join(path, "cgroup.kill"), "1")
            return
        _write(os.path.join(path, "cgroup.freeze"), "1")  # frozen, nothing forks while we kill
        for pid in _read(os.path.join(path, "cgroup.procs")).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _write(os.path.join(path, "cgroup.freeze"), "0")

    async def end_run(self, path: str, timeout_s: float = 5.0) -> None:
        """Kill what is left and remove the cgroup (it can only go once its processes are gone)."""
        try:
            self.kill(path)
        except OSError:
            pass
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                os.rmdir(path)
                return
            except OSError as e:
                if e.errno != errno.EBUSY or loop.time() > deadline:
                    return  # a leftover empty cgroup: harmless, removed with the pool at exit
            await asyncio.sleep(0.01)

    def close(self) -> None:
        for entry in os.scandir(self.dir):
            if entry.is_dir():
                try:
                    os.rmdir(entry.path)
                except OSError:
                    pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


@lru_cache(maxsize=None)
def _pool() -> CgroupPool | str:
    try:
        parent = os.environ.get("VIME_SANDBOX_CGROUP") or own_cgroup_dir(_read("/proc/self/mountinfo"),
                                                                         _read("/proc/self/cgroup"))
        pool = CgroupPool(parent)
    except CgroupUnavailable as e:
        return str(e)
    except OSError as e:
        return f"cgroup v2: {e}"
    atexit.register(pool.close)
    return pool


def cgroup_pool() -> CgroupPool | None:
    """This process's pool of sandbox cgroups, or None (see cgroup_reason)."""
    pool = _pool()
    return pool if isinstance(pool, CgroupPool) else None


def cgroup_reason() -> str:
    """'' when cgroup_pool() works, else why not."""
    pool = _pool()
    return "" if isinstance(pool, CgroupPool) else pool
