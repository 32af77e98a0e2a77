"""The sandbox interface and its plain data: `Sandbox.run(...) -> SandboxResult`, under `SandboxLimits`.

Re-exported by `vime.agents.sandbox`, where the implementations live; import from there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# Why a run stopped early. None: the program ended by itself (its exit code may still be non-zero).
# "tampering": the program wrote something into the sandbox's event log that the sandbox never writes.
STOP_REASONS = ("timeout", "memory", "forbidden_write", "network", "process_limit", "file_size", "output_limit",
                "killed", "disk_quota", "sandbox_error", "tampering")


@dataclass
class SandboxLimits:
    wall_time_s: float = 10.0  # the whole process tree is killed after this many seconds
    cpu_time_s: int | None = None  # RLIMIT_CPU per process (default: ceil(wall_time_s))
    memory_mb: int = 1024  # RLIMIT_AS per process, MiB of address space (and the sandbox's cgroup memory.max)
    max_processes: int = 32  # RLIMIT_NPROC of the sandbox's own uid or user namespace (and cgroup pids.max)
    max_file_size_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 65536  # stdout and stderr are each cut at this size (the run goes on)
    max_scratch_mb: int = 64  # all files in the sandbox's directory together, MiB
    allow_network: bool = False  # the host's network: all the node reaches (docs/guides/security.md)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "allow_network":
                if not isinstance(value, bool):
                    raise ValueError(f"sandbox limit allow_network must be true or false, got {value!r}")
            elif not (value is None and f.name == "cpu_time_s"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"sandbox limit {f.name} must be a positive number, got {value!r}")

    @property
    def cpu_seconds(self) -> int:
        return int(self.cpu_time_s) if self.cpu_time_s else max(1, math.ceil(self.wall_time_s))

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SandboxLimits:
        d = d or {}
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown sandbox limits {sorted(unknown)}")
        return cls(**d)

    def clamped_to(self, cap: SandboxLimits) -> SandboxLimits:
        """These limits, none above `cap`'s (a service's own maximum); network only where `cap` allows it."""
        if self.allow_network and not cap.allow_network:
            raise SandboxRefused("this sandbox service does not allow network access (allow_network)")
        smaller = {f.name: min(getattr(self, f.name), getattr(cap, f.name)) for f in dataclasses.fields(self)
                   if f.name not in ("cpu_time_s", "allow_network")}
        return dataclasses.replace(self, **smaller, cpu_time_s=min(self.cpu_seconds, cap.cpu_seconds))


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal; None: never started
    stopped_reason: str | None = None  # one of STOP_REASONS, or None when the program ended by itself
    duration_s: float = 0.0
    violations: list[dict[str, str]] = field(default_factory=list)  # every refused action, in order
    weak_isolation: list[str] = field(default_factory=list)  # isolation missing in this run ([] = full)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.stopped_reason is None

    @property
    def sandbox_error(self) -> str | None:
        """What failed in the sandbox itself (the program never ran, or its end was never observed), or None:
        the infrastructure's failure, not the program's."""
        if self.stopped_reason != "sandbox_error":
            return None
        details = [v.get("detail") for v in self.violations if v.get("reason") == "sandbox_error" and v.get("detail")]
        return details[0] if details else (self.stderr.strip() or "sandbox_error")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SandboxRefused(RuntimeError):
    """The sandbox will not run this: its isolation is too weak here, or the limits asked for are not allowed."""


class Sandbox:
    """Runs `code` (Python source) or `command` (argv list or shell string) with `files` in a fresh directory."""

    async def run(self, code: str | None = None, command: list[str] | str | None = None,
                  files: dict[str, str | bytes] | None = None, limits: SandboxLimits | None = None) -> SandboxResult:
        raise NotImplementedError
