"""Landlock (Linux >= 5.13) for sandboxed programs: what they may read, write and signal.

    restrict(read=["/usr", ...], write=["/tmp/vime-sandbox-x/work"], deny_tcp=True)

- reads and execution only beneath `read` (system directories, the interpreter, the sandbox's own files): the
  trainer's files, other sandboxes' directories and secrets in /tmp or home directories are out of reach, even
  under the same uid;
- writes only beneath `write`;
- ABI >= 4: TCP bind and connect refused (when `deny_tcp`);
- ABI >= 6: no signals to processes outside the sandbox and no connections to abstract unix sockets made outside
  it (the trainer is outside even when it runs as the same uid);
- ABI >= 1: no ptrace of (so no /proc/PID/environ or /proc/PID/mem of) processes outside the sandbox.

Standard library only, no vime imports: the jail imports this module by file before any sandboxed code runs.
"""

from __future__ import annotations

import ctypes
import os
import struct

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same on x86_64 and aarch64
_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_BY_ABI = {1: (1 << 13) - 1, 2: 1 << 13, 3: 1 << 14}  # ABI 1: bits 0-12; 2: REFER; 3: TRUNCATE
_TRUNCATE = 1 << 14
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | _TRUNCATE  # the only rights a rule on a non-directory may hold
READ_RIGHTS = EXECUTE | READ_FILE | READ_DIR
_NET_BIND_CONNECT_TCP = 0b11  # ABI >= 4
_SCOPE_ABSTRACT_UNIX_SOCKET_AND_SIGNAL = 0b11  # ABI >= 6


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def abi() -> int:
    """The Landlock ABI version of this kernel, 0 when Landlock is off or missing."""
    version = _libc().syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    return max(int(version), 0)


def fs_rights(version: int) -> int:
    return sum(bits for level, bits in _FS_BY_ABI.items() if version >= level)


def ruleset_attr(version: int, deny_tcp: bool) -> bytes:
    """struct landlock_ruleset_attr as this ABI knows it (8, 16 or 24 bytes)."""
    if version >= 6:
        return struct.pack("=QQQ", fs_rights(version), _NET_BIND_CONNECT_TCP if deny_tcp else 0,
                           _SCOPE_ABSTRACT_UNIX_SOCKET_AND_SIGNAL)
    if version >= 4:
        return struct.pack("=QQ", fs_rights(version), _NET_BIND_CONNECT_TCP if deny_tcp else 0)
    return struct.pack("=Q", fs_rights(version))


def describe(version: int, deny_tcp: bool) -> str:
    parts = [f"landlock abi {version}: reads beneath allowed paths, writes in the sandbox directory"]
    if version >= 4 and deny_tcp:
        parts.append("no tcp")
    if version >= 6:
        parts.append("no signals or abstract unix sockets outside")
    return ", ".join(parts)


def restrict(read: list[str], write: list[str], deny_tcp: bool) -> str:
    """Restrict this process and its future children; returns describe(...). Missing paths are skipped."""
    version = abi()
    if version < 1:
        raise OSError(0, "Landlock is not available in this kernel")
    libc = _libc()
    handled = fs_rights(version)
    attr = ruleset_attr(version, deny_tcp)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for paths, rights in ((read, READ_RIGHTS), (write, handled)):
            for path in paths:
                _add_rule(libc, ruleset, path, rights & handled)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return describe(version, deny_tcp)


def _blocked_at(path: str) -> str:
    """The first directory on the way to `path` that this process may not search."""
    directory = "/"
    for part in path.strip("/").split("/")[:-1]:
        directory = os.path.join(directory, part)
        if not os.access(directory, os.X_OK):
            return f"{directory} (mode {os.stat(directory).st_mode & 0o7777:o}, uid {os.stat(directory).st_uid})"
    return path


def _add_rule(libc, ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except PermissionError as e:
        raise PermissionError(e.errno, f"{path} is out of reach of uid {os.getuid()}: {_blocked_at(path)} may not "
                                       "be searched by it") from None
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS
        rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
        if libc.syscall(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                        ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
    finally:
        os.close(fd)
