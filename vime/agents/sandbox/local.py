"""`LocalSandbox`: one run in a subprocess (`jail.py`) with the isolation this machine allows, and `make_sandbox`,
which picks the local or the HTTP sandbox from --agent-sandbox."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vime.agents.sandbox.cgroup import cgroup_pool
from vime.agents.sandbox.events import parse_jail_events, parse_program_events
from vime.agents.sandbox.interface import Sandbox, SandboxLimits, SandboxResult
from vime.agents.sandbox.isolation import Isolation, note_weak_run, probe_isolation, refusal, warn_network_run
from vime.agents.sandbox.paths import default_python, hidden_dirs, python_prefixes
from vime.agents.sandbox.service import HTTPSandbox
from vime.agents.sandbox.slots import DEFAULT_SLOTS, DEFAULT_UID_BASE, Slot, UidPool, kill_uid
from vime.agents.sandbox.verdict import run_result

logger = logging.getLogger(__name__)
_HERE = Path(__file__).resolve().parent
_JAIL = _HERE / "jail.py"
_SITE_HOOKS = _HERE / "site_hooks" / "sitecustomize.py"
# what any program may read (and execute): the system, never /tmp, /home, /root or /run
SYSTEM_READ_PATHS = ("/bin", "/sbin", "/usr", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/proc", "/sys",
                     "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_SCRATCH_CHECK_S = 0.2


def _safe_relative(name: str) -> Path:
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"sandbox file name must be a relative path inside the sandbox, got {name!r}")
    return path


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Read to EOF keeping the first `cap` bytes (draining the rest so the program never blocks)."""
    kept, truncated = bytearray(), False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if len(chunk) > room:
            truncated = True
        kept += chunk[:max(room, 0)]
    return bytes(kept), truncated


_MAX_HINTS_BYTES = 2**20


def _read_hints(path: Path) -> str:
    """The program's own event log (untrusted: see events.py), at most its first MiB."""
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_HINTS_BYTES).decode(errors="replace")
    except OSError:
        return ""


def _drain(fd: int) -> bytes:
    """Everything in the jail's status pipe; every writer is gone by now, so this never waits."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:  # a writer is still alive (it should not be): take what is there
        pass
    return b"".join(chunks)


def _dir_usage(path: Path, cap: int) -> int:
    """Bytes the files under `path` take (stops counting past `cap`)."""
    total, stack = 0, [str(path)]
    while stack and total <= cap:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    st = entry.stat(follow_symlinks=False)
                    total += st.st_blocks * 512 + 4096 * entry.is_dir(follow_symlinks=False)
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue
    return total


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class LocalSandbox(Sandbox):
    """A subprocess sandbox on this machine; see the module docstring for what is enforced and how.

    python: interpreter for `code` (default: this one, or a system one every uid may run when root);
    base_dir: where the temporary directories go; read_paths: more paths programs may read (and execute);
    allow_weak_isolation: run even without network + pid + file-system isolation (logged, counted);
    namespaces / cgroups / landlock: False turns that mechanism off (tests of the weaker paths);
    uid_base / slots: as root, sandboxes run as uids uid_base .. uid_base + slots - 1, one per running sandbox
    (at most `slots` run at once, the others wait).
    """

    def __init__(self, python: str | None = None, base_dir: str | None = None, landlock: bool = True,
                 allow_weak_isolation: bool = False, namespaces: bool = True, cgroups: bool = True,
                 uid_base: int = DEFAULT_UID_BASE, slots: int = DEFAULT_SLOTS, read_paths: tuple[str, ...] = ()):
        self.is_root = hasattr(os, "geteuid") and os.geteuid() == 0
        self._python = python
        self.base_dir = base_dir
        self.landlock, self.namespaces, self.cgroups = landlock, namespaces, cgroups
        self.allow_weak_isolation = allow_weak_isolation
        self.uid_range = (uid_base, slots) if self.is_root else None
        self.read_paths = tuple(read_paths)
        self._uids: UidPool | None = None
        self._reported = False

    def _isolation(self) -> Isolation:
        iso = probe_isolation(self.is_root, self.namespaces, self.cgroups, self.uid_range)
        return iso if self.landlock else dataclasses.replace(iso, landlock_abi=0)

    def _hidden(self) -> list[str]:
        """What the jail hides here (none without masking)."""
        return hidden_dirs() if self._isolation().masking else []

    @property
    def python(self) -> str:
        """The programs' interpreter: the one given, else this one where the sandbox's uid can run it inside the
        jail, else a system one (`paths.default_python`)."""
        if self._python is None:
            self._python = default_python(self.is_root, self._hidden())
        return self._python

    @property
    def isolation(self) -> dict[str, Any]:
        """What runs get here: see Isolation.report (strong, missing, namespaces, Landlock ABI, seccomp, ...)."""
        return self._isolation().report()

    def check_isolation(self) -> dict[str, Any]:
        """The isolation report (logged the first time); raises SandboxRefused if too weak and not allowed."""
        report = self.isolation
        if report["missing"] and not self.allow_weak_isolation:
            raise refusal(report["missing"])
        self.python  # noqa: B018  (an interpreter the sandbox's uid cannot run is refused now, not at the first run)
        if not self._reported:
            self._reported = True
            log = logger.warning if report["missing"] else logger.info
            log("sandbox isolation: %s", json.dumps(report))
        return report

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
        if (code is None) == (command is None):
            raise ValueError("pass exactly one of code= or command=")
        for name in files or {}:
            _safe_relative(name)
        self.check_isolation()
        iso = self._isolation()
        missing = [m for m in iso.missing() if not (m == "network" and limits.allow_network)]
        if missing:
            note_weak_run(missing)
        if limits.allow_network:
            warn_network_run(iso)
        slot = None
        if self.uid_range:
            self._uids = self._uids or UidPool(*self.uid_range)
            slot = await self._uids.acquire()
        root = Path(tempfile.mkdtemp(prefix="vime-sandbox-", dir=self.base_dir))
        try:
            result = await self._run_in(root, iso, slot, code, command, files or {}, limits)
        finally:
            if slot is not None:
                await self._uids.release(slot)
            shutil.rmtree(root, ignore_errors=True)
        result.weak_isolation = missing
        return result

    def _env(self, work: Path, hints: Path, limits: SandboxLimits, run_id: str) -> dict[str, str]:
        """All the program sees of an environment: nothing of the trainer's (tokens, keys, paths)."""
        return {
            "PATH": f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin", "HOME": str(work),
            "TMPDIR": str(work), "LANG": "C.UTF-8", "PYTHONPATH": str(work.parent / "site"), "PYTHONNOUSERSITE": "1",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "VIME_SANDBOX_ROOT": str(work),
            "VIME_SANDBOX_EVENTS": str(hints), "VIME_SANDBOX_ALLOW_NETWORK": "1" if limits.allow_network else "0",
            "VIME_SANDBOX_ID": run_id, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        }

    def _read_paths(self, root: Path) -> list[str]:
        return [*SYSTEM_READ_PATHS, *python_prefixes(self.python), str(root), *self.read_paths]

    def _prepare(self, root: Path, iso: Isolation, slot: Slot | None, code, command, files, limits) -> dict:
        """The run's directory (program, files, the program's event log, scratch) and the jail's config."""
        work, events, site = root / "work", root / "program_events.jsonl", root / "site"
        stage = root / "files" if iso.tmpfs else work  # with a tmpfs the jail copies the files into it
        work.mkdir()
        # the site hooks travel with the run: the package's own copy may lie where the sandbox's uid cannot reach
        site.mkdir()
        shutil.copyfile(_SITE_HOOKS, site / "sitecustomize.py")
        os.chmod(site, 0o755)
        os.chmod(site / "sitecustomize.py", 0o644)
        stage.mkdir(exist_ok=True)
        for name, content in files.items():
            path = stage / _safe_relative(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.encode() if isinstance(content, str) else content)
        argv = self._argv(code, command, root)
        events.touch()
        if slot is not None:  # the slot's uid owns what the program may touch; root keeps the rest
            os.chmod(root, 0o711)
            program = [p for p in [root / "program.py"] if p.exists()]
            for path in [work, events, *program, *([] if iso.tmpfs else work.rglob("*"))]:
                os.chown(path, slot.uid, slot.gid, follow_symlinks=False)
            for path, mode in [(work, 0o700), (stage, 0o700), (events, 0o600), *[(p, 0o600) for p in program]]:
                os.chmod(path, mode)
        write = [str(work), str(events), "/dev/null"]
        return {
            "cwd": str(work), "argv": argv, "env": self._env(work, events, limits, root.name),
            "program_events": str(events),
            "parent_mnt_ns": os.stat("/proc/self/ns/mnt").st_ino,
            "tmpfs": {"size_mb": limits.max_scratch_mb, "nr_inodes": 16384} if iso.tmpfs else None,
            "mask": ({"dirs": hidden_dirs(), "keep": [str(root), *self._read_paths(root)]} if iso.masking else None),
            "stage": str(stage),
            "uid": slot.uid if slot else None, "gid": slot.gid if slot else None,
            "nproc_shared": slot is None and not iso.user_namespace,
            "kill_uid_at_exit": slot is not None and not iso.pid_namespace,
            "rlimits": {"CPU": limits.cpu_seconds, "AS": limits.memory_mb * 2**20,
                        "FSIZE": limits.max_file_size_mb * 2**20, "NOFILE": limits.max_open_files,
                        "NPROC": limits.max_processes, "CORE": 0},
            "landlock": ({"read": self._read_paths(root), "write": write, "deny_tcp": not limits.allow_network}
                         if iso.landlock_abi else None),
            "seccomp": ({"arch": iso.seccomp_arch, "deny_network": not limits.allow_network,
                         "deny_new_session": iso.deny_new_session} if iso.seccomp_arch else None),
        }

    async def _run_in(self, root: Path, iso: Isolation, slot: Slot | None, code, command, files,
                      limits: SandboxLimits) -> SandboxResult:
        """Start the jail, wait at most the wall time, kill everything left, then say why it stopped."""
        config = self._prepare(root, iso, slot, code, command, files, limits)
        pool = cgroup_pool() if iso.cgroup_dir else None
        if pool is not None:
            config["cgroup"] = pool.start_run(root.name, (limits.memory_mb + limits.max_scratch_mb) * 2**20,
                                              limits.max_processes + 1)  # + the jail
        prefix = iso.prefix_network if limits.allow_network else iso.prefix
        status_read, status_write = os.pipe()  # the jail's report; only the jail holds the write end
        config["status_fd"] = status_write
        config_path = root / "jail.json"
        config_path.write_text(json.dumps(config))
        os.chmod(config_path, 0o600)
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *prefix, sys.executable, "-S", str(_JAIL), str(config_path), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
                env=config["env"], pass_fds=(status_write,))
        except BaseException:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
        try:
            ended = await self._supervise(proc, config, iso, slot, pool, limits)
            jail = parse_jail_events(_drain(status_read))
        finally:
            os.close(status_read)
        hints = parse_program_events(_read_hints(Path(config["program_events"])))
        return run_result(*ended, jail, hints, time.monotonic() - start)

    async def _supervise(self, proc, config: dict, iso: Isolation, slot: Slot | None, pool,
                         limits: SandboxLimits) -> tuple:
        """Wait at most the wall time, kill everything left; (out, err, out_cut, err_cut, returncode, timed_out,
        scratch_full, oom)."""
        readers = asyncio.gather(_read_capped(proc.stdout, limits.max_output_bytes),
                                 _read_capped(proc.stderr, limits.max_output_bytes))
        cap = limits.max_scratch_mb * 2**20
        watcher = None if iso.tmpfs else asyncio.ensure_future(_watch_scratch(Path(config["cwd"]), cap, proc.pid))
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout=limits.wall_time_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # the namespace dies with its pid 1; without one, the group, the cgroup or the slot's uid
            _kill_group(proc.pid)
            if watcher is not None:
                watcher.cancel()
            if pool is not None:
                await pool.end_run(config["cgroup"])
            if slot is not None and not iso.pid_namespace:  # a setsid child would hold the output pipes open
                await kill_uid(slot.uid, slot.gid)
        try:
            (out, out_cut), (err, err_cut) = await asyncio.wait_for(readers, timeout=5)
            await proc.wait()  # asyncio's wait() also waits for the pipes to close: only once they did
        except asyncio.TimeoutError:  # a descendant escaped and holds the pipes open
            readers.cancel()
            out, err, out_cut, err_cut = b"", b"sandbox: output pipes did not close\n", False, False
        scratch_full = watcher is not None and (watcher.done() and not watcher.cancelled() and watcher.result()
                                                or _dir_usage(Path(config["cwd"]), cap) > cap)  # one last look
        oom = pool is not None and pool.oom_killed(config["cgroup"])
        return out, err, out_cut, err_cut, proc.returncode, timed_out, scratch_full, oom


async def _watch_scratch(work: Path, cap: int, pgid: int) -> bool:
    """Without a tmpfs: kill the run once its directory holds more than `cap` bytes (True when it did)."""
    while True:
        await asyncio.sleep(_SCRATCH_CHECK_S)
        if _dir_usage(work, cap) > cap:
            _kill_group(pgid)
            return True


def make_sandbox(spec: str | None = None, allow_weak_isolation: bool = False) -> Sandbox:
    """`None`/"local" -> LocalSandbox() (its isolation checked now); "http://host:port" -> HTTPSandbox(url)
    (token from VIME_SANDBOX_TOKEN)."""
    if not spec or spec == "local":
        sandbox = LocalSandbox(allow_weak_isolation=allow_weak_isolation)
        sandbox.check_isolation()
        return sandbox
    if spec.startswith(("http://", "https://")):
        return HTTPSandbox(spec)
    raise ValueError(f"sandbox must be 'local' or an http(s) URL of a sandbox service, got {spec!r}")

