"""Inside a LocalSandbox: drop privileges, set limits, restrict writes, then run the program and reap.

Run as `python -S sandbox_jail.py CONFIG.json` by LocalSandbox, usually as pid 1 of a fresh pid (and network)
namespace made by `unshare`. Standard library only, no site packages: it runs before any sandboxed code.
It forks the program, waits for it and exits with its status; when it exits the kernel kills every process
left in the pid namespace, so nothing the program started outlives the run.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import struct
import sys

# Landlock (Linux >= 5.13), syscall numbers shared by x86_64 and aarch64.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
# Write-like file-system rights; reads and execution stay unrestricted.
_WRITE_RIGHTS_BY_ABI = {
    1: (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12),
    2: 1 << 13,  # REFER (moving files between directories)
    3: 1 << 14,  # TRUNCATE
}
_NET_TCP_BIND_CONNECT = 0b11  # ABI >= 4


def _event(path: str, **fields) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def apply_landlock(writable: list[str], deny_tcp: bool) -> str:
    """Allow writes only beneath `writable`; returns what was applied ("" when Landlock is unavailable)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # 1 = VERSION
    if abi < 1:
        return ""
    rights = 0
    for level, bits in _WRITE_RIGHTS_BY_ABI.items():
        if abi >= level:
            rights |= bits
    net = _NET_TCP_BIND_CONNECT if deny_tcp and abi >= 4 else 0
    attr = struct.pack("=QQ", rights, net) if abi >= 4 else struct.pack("=Q", rights)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        return ""
    for path in writable:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        allowed = rights if os.path.isdir(path) else rights & ((1 << 1) | (1 << 14))  # files: write, truncate
        rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
        if libc.syscall(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                        ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
        os.close(fd)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if libc.syscall(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)
    return f"landlock-abi{abi}" + ("+tcp" if net else "")


def tasks_of_user(uid: int) -> int:
    """Processes and threads this user runs now: what RLIMIT_NPROC counts when the user is shared."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return count


def main(config_path: str) -> None:
    with open(config_path) as f:
        cfg = json.load(f)
    events = cfg["events"]
    limits = cfg["rlimits"]
    for name, value in limits.items():
        if name != "NPROC" and value is not None:
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
    if cfg.get("uid") is not None:  # started as root: run as an unprivileged user so RLIMIT_NPROC holds
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    if limits.get("NPROC") is not None:
        nproc = limits["NPROC"]
        if cfg.get("uid") is None and not cfg.get("own_user_namespace"):  # the count is shared with the user
            nproc += tasks_of_user(os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    applied = ""
    if cfg.get("landlock", True):
        try:
            applied = apply_landlock(cfg["writable"], deny_tcp=not cfg["allow_network"])
        except OSError as e:
            _event(events, event="isolation_warning", message=f"landlock: {e}")
    _event(events, event="isolation", landlock=applied)

    pid = os.fork()
    if pid == 0:
        os.chdir(cfg["cwd"])
        try:
            os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
        except OSError as e:
            os.write(2, f"sandbox: cannot run {cfg['argv'][0]}: {e}\n".encode())
            os._exit(127)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # pass polite signals on to the program
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    while True:  # as pid 1, reap every orphan until the program itself exits
        try:
            waited, status = os.wait()
        except ChildProcessError:
            sys.exit(1)
        if waited == pid:
            break
    if os.WIFSIGNALED(status):
        _event(events, event="exit", signal=os.WTERMSIG(status))
        sys.exit(128 + os.WTERMSIG(status))
    sys.exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main(sys.argv[1])
