"""Shared directories hidden from a sandboxed program: an empty read-only tmpfs over each, in its mount namespace.

    hidden = mask_directories(["/tmp", "/run", "/dev/shm", "/home", "/root"], keep=["/tmp/vime-sandbox-x", ...])

/tmp, /run, /dev/shm and home directories are where other processes leave UNIX sockets (D-Bus, docker.sock, Ray's
sockets under /tmp/ray), shared memory and secrets. Seccomp already refuses every UNIX socket a program could
connect and Landlock refuses reads there; this takes the names away as well, so a path the other two miss (a kernel
where one of them is weaker) still leads nowhere. Paths the run needs beneath a hidden directory (its own
directory, an interpreter in a home directory) are bound back in place. Only ever call it in a mount namespace of
the sandbox's own: it changes what every process of the namespace sees.

Standard library only, no vime imports: the jail imports this module by file before any sandboxed code runs.
"""

from __future__ import annotations

import ctypes
import os
import stat

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        raise OSError(ctypes.get_errno(), f"mount {source} on {target}")


def beneath(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def plan(masked: list[str], keep: list[str]) -> list[tuple[str, list[str]]]:
    """[(directory to hide, the kept paths beneath it)], outermost first: existing directories only, none that is
    (or lies beneath) a kept path, none beneath another hidden one."""
    keep = sorted({os.path.realpath(k) for k in keep if os.path.exists(k)})
    steps: list[tuple[str, list[str]]] = []
    for target in sorted({os.path.realpath(m) for m in masked}, key=lambda p: (p.count("/"), p)):
        if target == "/" or not os.path.isdir(target) or any(beneath(target, k) for k in keep):
            continue
        if any(beneath(target, done) for done, _ in steps):
            continue
        steps.append((target, [k for k in keep if beneath(k, target)]))
    return steps


def _searchable_dirs(path: str) -> None:
    """`path` and its missing parents made inside the tmpfs, each 0755 whatever the umask: a run creates everything
    under umask 077 (`private_umask`), and a 0700 root-owned directory on the way would keep the sandbox's own uid
    from every path bound back beneath it. They hold nothing but the names of the paths bound back."""
    parent = os.path.dirname(path)
    if parent != path and not os.path.isdir(parent):
        _searchable_dirs(parent)
    if not os.path.isdir(path):
        os.mkdir(path)
        os.chmod(path, 0o755)


def _bind_back(fd: int, path: str) -> None:
    """`path` (now inside the empty tmpfs) made a mount point again, with what `fd` held bound onto it; the
    directories on the way are the tmpfs's own, searchable by every uid (what is bound keeps its own modes)."""
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        _searchable_dirs(path)
    else:
        _searchable_dirs(os.path.dirname(path))
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)


def mask_directories(masked: list[str], keep: list[str]) -> list[str]:
    """Hide each directory of plan(masked, keep); returns those hidden. Raises OSError when a step fails."""
    hidden = []
    for target, kept in plan(masked, keep):
        fds = [os.open(k, os.O_PATH | os.O_CLOEXEC) for k in kept]  # before the names disappear
        try:
            _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,nr_inodes=256,mode=0755")
            for path, fd in zip(kept, fds):
                _bind_back(fd, path)
            _mount(None, target, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        finally:
            for fd in fds:
                os.close(fd)
        hidden.append(target)
    return hidden
