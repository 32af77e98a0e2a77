"""Why a sandboxed run stopped and how it ended (`SandboxResult`), from what the jail observed, the limits the
supervisor saw hit, the program's own hints and its stderr's words. The jail's report through its status pipe is
the only source of an exit code; the program's hints (`events.py`) can name a cause, never a success.
"""

from __future__ import annotations

import os
import signal

from vime.agents.sandbox.events import JailReport
from vime.agents.sandbox.interface import SandboxResult


def run_result(out: bytes, err: bytes, out_cut: bool, err_cut: bool, returncode: int | None, timed_out: bool,
            scratch_full: bool, oom: bool, jail: JailReport, hints: list[dict[str, str]],
            duration: float) -> SandboxResult:
    """Why the run stopped and how it ended. The exit code is the wait status the jail observed (or, when the jail
    itself was killed, how the jail ended); the program's own hints only ever name a cause, never a success."""
    violations = list(hints)
    if jail.isolation_error is not None:
        violations.append({"reason": "sandbox_error", "detail": jail.isolation_error})
    violations += [{"reason": "sandbox_error", "detail": f"the jail reported nonsense: {p}"} for p in jail.problems]
    stderr = err.decode(errors="replace")
    signalled = None
    exit_code = returncode
    if jail.exit_status is not None:
        if os.WIFSIGNALED(jail.exit_status):
            signalled = os.WTERMSIG(jail.exit_status)
            exit_code = -signalled
        else:
            exit_code = os.WEXITSTATUS(jail.exit_status)
    reason = violations[0]["reason"] if violations else None
    if reason is None and scratch_full:
        reason = "disk_quota"
    if reason is None and oom:
        reason = "memory"
    reason = reason or stderr_reason(stderr)
    if reason is None:
        if timed_out or signalled == signal.SIGXCPU:
            reason = "timeout"
        elif signalled == signal.SIGXFSZ:
            reason = "file_size"
        elif signalled == signal.SIGKILL:
            reason = "killed"
        elif out_cut or err_cut:
            reason = "output_limit"
        elif jail.exit_status is None:  # the jail ended (or was ended) without a word about the program
            reason = "sandbox_error"
            violations.append({"reason": "sandbox_error",
                               "detail": f"the jail ended with {returncode} before reporting the program's exit"})
    if jail.isolation_error is not None:
        reason, exit_code = "sandbox_error", None  # the program never started
    elif (timed_out or scratch_full) and exit_code is not None and exit_code >= 0:
        exit_code = -signal.SIGKILL
    return SandboxResult(stdout=out.decode(errors="replace"), stderr=stderr, exit_code=exit_code,
                         stopped_reason=reason, duration_s=duration, violations=violations[:50])


def stderr_reason(stderr: str) -> str | None:
    """Causes a non-Python program reports only in words (shell fork failures, ...)."""
    lowered = stderr.lower()
    if "cannot fork" in lowered or ("fork" in lowered and "resource temporarily unavailable" in lowered):
        return "process_limit"
    if "no space left on device" in lowered or "disk quota exceeded" in lowered:
        return "disk_quota"
    if "/dev/tcp/" in lowered or "/dev/udp/" in lowered or "socket: operation not permitted" in lowered:
        return "network"
    tools = ("touch:", "mkdir:", "cp:", "mv:", "rm:")
    if any(w in lowered for w in ("cannot create", "can't create", "read-only file system")) \
            or ("permission denied" in lowered and any(w in lowered for w in tools)):
        return "forbidden_write"
    if "memoryerror" in lowered or "cannot allocate memory" in lowered:
        return "memory"
    return None
