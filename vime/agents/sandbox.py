"""Sandboxes that run untrusted code (model-written programs, tests) with limits, and say why they stopped.

    result = await LocalSandbox().run(code="print(1 + 1)", limits=SandboxLimits(wall_time_s=5))
    result.stdout == "2\\n"; result.stopped_reason is None

`Sandbox` is the interface: `run(code=... | command=..., files=..., limits=...) -> SandboxResult`.
`LocalSandbox` runs a subprocess in a fresh temporary directory:
- wall time: the whole process tree is killed (a pid namespace when `unshare` works, else the process group);
- CPU time, memory (RLIMIT_AS), file size, open files: rlimits;
- processes: RLIMIT_NPROC; as root the program runs as an unprivileged user (`sandbox_uid`, default nobody)
  since root ignores that limit; otherwise a fresh user namespace gives it its own count;
- file system: writes outside the sandbox directory are refused by Landlock (Linux >= 5.13) and, for Python,
  by an audit hook that also records the refusal;
- network: off by default, a fresh network namespace (`unshare -n`) plus the audit hook (and Landlock TCP rules).
What is actually in force on this machine is in `LocalSandbox().isolation`.
`HTTPSandbox` implements the same interface against a remote service; `sandbox_app` serves any sandbox over
HTTP (POST /run), so a sandbox can live on another machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_JAIL = _HERE / "sandbox_jail.py"
_SITE = _HERE / "sandbox_site"

# Why a run stopped early. None: the program ended by itself (its exit code may still be non-zero).
STOP_REASONS = ("timeout", "memory", "forbidden_write", "network", "process_limit", "file_size", "output_limit",
                "killed")


@dataclass
class SandboxLimits:
    wall_time_s: float = 10.0  # the whole process tree is killed after this many seconds
    cpu_time_s: int | None = None  # RLIMIT_CPU per process (default: ceil(wall_time_s))
    memory_mb: int = 1024  # RLIMIT_AS per process, MiB of address space
    max_processes: int = 32  # RLIMIT_NPROC: processes and threads of the sandbox user
    max_file_size_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 65536  # stdout and stderr are each cut at this size (the run goes on)
    allow_network: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SandboxLimits:
        d = d or {}
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown sandbox limits {sorted(unknown)}")
        return cls(**d)


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal; None: never started
    stopped_reason: str | None = None  # one of STOP_REASONS, or None when the program ended by itself
    duration_s: float = 0.0
    violations: list[dict[str, str]] = field(default_factory=list)  # every refused action, in order

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.stopped_reason is None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Sandbox:
    """Runs `code` (Python source) or `command` (argv list or shell string) with `files` in a fresh directory."""

    async def run(self, code: str | None = None, command: list[str] | str | None = None,
                  files: dict[str, str | bytes] | None = None, limits: SandboxLimits | None = None) -> SandboxResult:
        raise NotImplementedError


def _safe_relative(name: str) -> Path:
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"sandbox file name must be a relative path inside the sandbox, got {name!r}")
    return path


@lru_cache(maxsize=None)
def _unshare_flags(is_root: bool, network: bool) -> tuple[str, ...] | None:
    """`unshare` options that work unprivileged here (pid namespace, +network when asked), or None."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return None
    flags = ["--fork", "--pid", "--kill-child"]
    if not is_root:
        flags += ["--user", "--map-root-user"]
    if network:
        flags.append("--net")
    try:
        ok = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (exe, *flags) if ok else None


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Read to EOF keeping the first `cap` bytes (draining the rest so the program never blocks)."""
    kept, truncated = bytearray(), False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if len(chunk) > room:
            truncated = True
        kept += chunk[:max(room, 0)]
    return bytes(kept), truncated


def _read_events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    events = []
    for line in lines[:1000]:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line from a killed process
    return events


def _stderr_reason(stderr: str) -> str | None:
    """Causes a non-Python program reports only in words (shell fork failures, ...)."""
    lowered = stderr.lower()
    if "cannot fork" in lowered or ("fork" in lowered and "resource temporarily unavailable" in lowered):
        return "process_limit"
    if any(w in lowered for w in ("cannot create", "can't create", "read-only file system")) \
            or ("permission denied" in lowered and any(w in lowered for w in ("touch:", "mkdir:", "cp:", "mv:", "rm:"))):
        return "forbidden_write"
    if "memoryerror" in lowered or "cannot allocate memory" in lowered:
        return "memory"
    return None


def _world_executable(path: str) -> bool:
    """Whether any user may run `path` (every directory on the way searchable, the file executable)."""
    real = Path(os.path.realpath(path))
    try:
        return all(p.stat().st_mode & 0o001 for p in [real, *real.parents])
    except OSError:
        return False


def _default_python(is_root: bool) -> str:
    """This interpreter, unless the unprivileged sandbox user cannot run it (e.g. it lives under /root)."""
    if not is_root or _world_executable(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _world_executable(candidate):
            return candidate
    raise RuntimeError(f"no Python the sandbox user may run: {sys.executable} is not world-executable; "
                       "pass LocalSandbox(python=...) or sandbox_uid of a user who can run it")


class LocalSandbox(Sandbox):
    """A subprocess sandbox on this machine; see the module docstring for what is enforced and how.

    sandbox_uid/gid: user the program runs as when vime runs as root (default 65534, nobody);
    python: interpreter for `code` (default: this one); base_dir: where temporary directories go.
    """

    def __init__(self, sandbox_uid: int = 65534, sandbox_gid: int = 65534, python: str | None = None,
                 base_dir: str | None = None, landlock: bool = True):
        self.is_root = hasattr(os, "geteuid") and os.geteuid() == 0
        self.sandbox_uid, self.sandbox_gid = sandbox_uid, sandbox_gid
        self.python = python or _default_python(self.is_root)
        self.base_dir = base_dir
        self.landlock = landlock

    @property
    def isolation(self) -> dict[str, Any]:
        return {"pid_namespace": _unshare_flags(self.is_root, False) is not None,
                "network_namespace": _unshare_flags(self.is_root, True) is not None,
                "drops_to_uid": self.sandbox_uid if self.is_root else None}

    def _argv(self, code: str | None, command: list[str] | str | None, root: Path) -> list[str]:
        if (code is None) == (command is None):
            raise ValueError("pass exactly one of code= or command=")
        if code is not None:
            program = root / "program.py"
            program.write_text(code)
            return [self.python, str(program)]
        if isinstance(command, str):
            return ["/bin/sh", "-c", command]
        if not command:
            raise ValueError("command is empty")
        exe = command[0] if os.sep in command[0] else (shutil.which(command[0]) or command[0])
        return [exe, *command[1:]]

    async def run(self, code: str | None = None, command: list[str] | str | None = None,
                  files: dict[str, str | bytes] | None = None, limits: SandboxLimits | None = None) -> SandboxResult:
        limits = limits or SandboxLimits()
        root = Path(tempfile.mkdtemp(prefix="vime-sandbox-", dir=self.base_dir))
        try:
            return await self._run_in(root, code, command, files or {}, limits)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    async def _run_in(self, root: Path, code, command, files, limits: SandboxLimits) -> SandboxResult:
        work, events = root / "work", root / "events.jsonl"
        work.mkdir()
        for name, content in files.items():
            path = work / _safe_relative(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.encode() if isinstance(content, str) else content)
        argv = self._argv(code, command, root)
        events.touch()
        os.chmod(root, 0o755)
        if self.is_root:  # the program runs as the sandbox user: it owns its directory and the event log
            for path in [work, events, *work.rglob("*")]:
                os.chown(path, self.sandbox_uid, self.sandbox_gid)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "TMPDIR": str(work),
            "LANG": "C.UTF-8", "PYTHONPATH": str(_SITE), "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1", "VIME_SANDBOX_ROOT": str(work), "VIME_SANDBOX_EVENTS": str(events),
            "VIME_SANDBOX_ALLOW_NETWORK": "1" if limits.allow_network else "0",
            "VIME_SANDBOX_ID": root.name, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        }
        config = {
            "events": str(events), "cwd": str(work), "argv": argv, "env": env, "allow_network": limits.allow_network,
            "writable": [str(work), str(events), "/dev/null"], "landlock": self.landlock,
            "uid": self.sandbox_uid if self.is_root else None, "gid": self.sandbox_gid if self.is_root else None,
            "rlimits": {"CPU": limits.cpu_time_s or max(1, int(limits.wall_time_s + 0.999)),
                        "AS": limits.memory_mb * 2**20, "FSIZE": limits.max_file_size_mb * 2**20,
                        "NOFILE": limits.max_open_files, "NPROC": limits.max_processes, "CORE": 0},
        }
        prefix = _unshare_flags(self.is_root, not limits.allow_network) or ()
        config["own_user_namespace"] = "--user" in prefix
        config_path = root / "jail.json"
        config_path.write_text(json.dumps(config))
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-S", str(_JAIL), str(config_path), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True, env=env)
        readers = asyncio.gather(_read_capped(proc.stdout, limits.max_output_bytes),
                                 _read_capped(proc.stderr, limits.max_output_bytes))
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout=limits.wall_time_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # the namespace dies with its pid 1; the group kill covers the no-namespace fallback
            _kill_group(proc.pid)
        await proc.wait()
        try:
            (out, out_cut), (err, err_cut) = await asyncio.wait_for(readers, timeout=5)
        except asyncio.TimeoutError:  # a descendant escaped and holds the pipes open
            readers.cancel()
            out, err, out_cut, err_cut = b"", b"sandbox: output pipes did not close\n", False, False
        duration = time.monotonic() - start

        logged = _read_events(events)
        violations = [{"reason": e["reason"], "detail": e.get("detail", "")} for e in logged
                      if e.get("event") == "violation"][:50]
        stderr = err.decode(errors="replace")
        exit_code = proc.returncode
        signalled = next((e["signal"] for e in logged if e.get("event") == "exit"), None)
        if signalled is not None:
            exit_code = -signalled
        reason = violations[0]["reason"] if violations else _stderr_reason(stderr)
        if reason is None:
            if timed_out or signalled == signal.SIGXCPU:
                reason = "timeout"
            elif signalled == signal.SIGXFSZ:
                reason = "file_size"
            elif signalled == signal.SIGKILL:
                reason = "killed"
            elif out_cut or err_cut:
                reason = "output_limit"
        if timed_out and exit_code is not None and exit_code >= 0:
            exit_code = -signal.SIGKILL
        return SandboxResult(stdout=out.decode(errors="replace"), stderr=stderr, exit_code=exit_code,
                             stopped_reason=reason, duration_s=duration, violations=violations)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class HTTPSandbox(Sandbox):
    """A sandbox service over HTTP: POST {url}/run with {code|command, files, limits} -> SandboxResult JSON."""

    def __init__(self, url: str, request_timeout_margin_s: float = 30.0):
        self.url = url.rstrip("/")
        self.margin = request_timeout_margin_s

    async def run(self, code: str | None = None, command: list[str] | str | None = None,
                  files: dict[str, str | bytes] | None = None, limits: SandboxLimits | None = None) -> SandboxResult:
        import aiohttp

        limits = limits or SandboxLimits()
        if any(isinstance(v, bytes) for v in (files or {}).values()):
            raise ValueError("HTTPSandbox sends files as text; decode bytes first")
        payload = {"code": code, "command": command, "files": files or {}, "limits": dataclasses.asdict(limits)}
        timeout = aiohttp.ClientTimeout(total=limits.wall_time_s + self.margin)
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + "/run", json=payload, timeout=timeout) as r:
                body = await r.json(content_type=None)
                if r.status != 200:
                    raise RuntimeError(f"sandbox service {self.url} answered HTTP {r.status}: {body}")
        return SandboxResult(**body)


def sandbox_app(sandbox: Sandbox):
    """An aiohttp application serving `sandbox` at POST /run (what HTTPSandbox talks to)."""
    from aiohttp import web

    async def run(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            limits = SandboxLimits.from_dict(body.get("limits"))
            result = await sandbox.run(code=body.get("code"), command=body.get("command"),
                                       files=body.get("files"), limits=limits)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(result.to_dict())

    app = web.Application()
    app.router.add_post("/run", run)
    return app


def make_sandbox(spec: str | None = None) -> Sandbox:
    """`None`/"local" -> LocalSandbox(); "http://host:port" -> HTTPSandbox(url)."""
    if not spec or spec == "local":
        return LocalSandbox()
    if spec.startswith(("http://", "https://")):
        return HTTPSandbox(spec)
    raise ValueError(f"sandbox must be 'local' or an http(s) URL of a sandbox service, got {spec!r}")


__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "LocalSandbox", "HTTPSandbox", "sandbox_app",
           "make_sandbox", "STOP_REASONS"]
