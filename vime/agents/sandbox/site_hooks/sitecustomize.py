"""Loaded by every Python interpreter inside a LocalSandbox (PYTHONPATH points here).

An audit hook refuses writes outside the sandbox directory and network connections (when disallowed) and
records each refusal as an event, so that the sandbox can say *why* a program stopped; uncaught MemoryError,
process-limit, file-size and full-scratch errors are recorded the same way. Landlock, seccomp and the network
namespace enforce the same rules in the kernel; this hook names the cause.
"""

import json
import os
import sys

_ROOT = os.environ.get("VIME_SANDBOX_ROOT")
_EVENTS = os.environ.get("VIME_SANDBOX_EVENTS")
_ALLOW_NET = os.environ.get("VIME_SANDBOX_ALLOW_NETWORK") == "1"
_WRITE_ALLOWED = ("/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty")


def _inside(path):
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return real == _ROOT or real.startswith(_ROOT + os.sep) or real in _WRITE_ALLOWED or real == _EVENTS


def _writes(mode, flags):
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))


class _Guard:
    """What the audit hook and the excepthook share: the causes already recorded (each once per process, so a
    fork bomb cannot flood the event log) and whether a record is being written (its own open() must pass)."""

    def __init__(self, events):
        self.events = events
        self.recording = False
        self.recorded = set()

    def record(self, reason, detail):
        if self.recording or reason in self.recorded:
            return
        self.recorded.add(reason)
        self.recording = True
        try:
            fd = os.open(self.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, (json.dumps({"event": "violation", "reason": reason, "detail": str(detail)[:300]}) + "\n")
                     .encode())
            os.close(fd)
        except OSError:
            pass
        finally:
            self.recording = False

    def hook(self, event, args):
        if self.recording:
            return
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None or not _writes(mode, flags) or _inside(path):
                return
            self.record("forbidden_write", path)
            raise PermissionError(f"sandbox: writing outside the sandbox directory is not allowed: {path}")
        if event in ("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.replace", "os.symlink", "os.link",
                     "os.chmod", "os.truncate", "shutil.rmtree"):
            paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
            if event in ("os.symlink", "os.link", "os.rename", "os.replace"):
                paths = paths[1:] if event in ("os.symlink", "os.link") else paths
            for p in paths:
                if not _inside(p):
                    self.record("forbidden_write", p)
                    raise PermissionError(f"sandbox: changing files outside the sandbox directory is not allowed: {p}")
        if not _ALLOW_NET and event == "socket.__new__":
            family = args[1]
            if family not in (-1, None, getattr(__import__("socket"), "AF_UNIX", None)):
                self.record("network", f"socket family {family}")
                raise PermissionError(f"sandbox: network access is not allowed (socket family {family})")
        if not _ALLOW_NET and event in ("socket.connect", "socket.sendto", "socket.bind"):
            sock, address = args[0], args[1]
            if getattr(sock, "family", None) == getattr(__import__("socket"), "AF_UNIX", None):
                return
            self.record("network", address)
            raise PermissionError(f"sandbox: network access is not allowed: {address}")


    def excepthook(self, kind, value, tb, _default=sys.excepthook):
        import errno

        if isinstance(value, MemoryError):
            self.record("memory", "MemoryError")
        elif isinstance(value, BlockingIOError) or (isinstance(value, OSError) and value.errno == errno.EAGAIN):
            self.record("process_limit", value)
        elif isinstance(value, OSError) and value.errno == errno.EFBIG:
            self.record("file_size", value)
        elif isinstance(value, OSError) and value.errno in (errno.ENOSPC, errno.EDQUOT):
            self.record("disk_quota", value)
        elif isinstance(value, PermissionError) and value.errno == errno.EPERM and _raised_in_socket(tb):
            self.record("network", f"socket refused by the sandbox: {value}")  # UNIX sockets too (seccomp)
        _default(kind, value, tb)


def _raised_in_socket(tb):
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.basename(tb.tb_frame.f_code.co_filename) == "socket.py"


def _guard_fork(record):
    real_fork = os.fork

    def fork():
        try:
            return real_fork()
        except BlockingIOError as e:  # RLIMIT_NPROC reached
            record("process_limit", e)
            raise

    os.fork = fork


if _ROOT and _EVENTS:
    _ROOT = os.path.realpath(_ROOT)
    _guard = _Guard(_EVENTS)  # held by the hooks installed below
    sys.addaudithook(_guard.hook)
    sys.excepthook = _guard.excepthook
    _guard_fork(_guard.record)
