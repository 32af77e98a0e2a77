"""Sandboxes that run untrusted code (model-written programs, tests) with limits, and say why they stopped.

    result = await LocalSandbox().run(code="print(1 + 1)", limits=SandboxLimits(wall_time_s=5))
    result.stdout == "2\\n"; result.stopped_reason is None

`Sandbox` is the interface: `run(code=... | command=..., files=..., limits=...) -> SandboxResult`.
`LocalSandbox` runs a subprocess (`jail.py`) in a fresh directory, with whatever of these the machine
allows (`LocalSandbox().isolation` is the report; `isolation.py` finds it by trying):
- its own pid namespace and /proc, mount namespace and network namespace (`unshare`; as non-root inside a user
  namespace of its own);
- as root a uid of its own per running sandbox (`slots.py`), so the process limit is per sandbox and
  the trainer's files and processes are another user's;
- Landlock (`landlock.py`): reads beneath system paths and its own directory only, writes in its
  directory only, no signals or abstract sockets outside;
- seccomp (`seccomp.py`): no sockets unless network is allowed, and never a UNIX socket that could connect to
  anything (D-Bus, docker.sock, Ray's sockets): connected pairs only; no new namespaces, no ptrace, io_uring,
  userfaultfd, bpf, keyrings or mounts;
- no capabilities (root in its own user namespace drops them all) and, as root, no supplementary groups;
- an empty read-only tmpfs over /tmp, /var/tmp, /run, /dev/shm, /home, /root and the trainer's home in its mount
  namespace (`masking.py`; the run's own paths bound back): other users' sockets and secrets have no name there;
- cgroup v2 memory.max and pids.max over the whole sandbox (`cgroup.py`);
- a tmpfs of `max_scratch_mb` as its directory (else a size check of the directory every 0.2 s);
- rlimits per process: CPU time, address space, file size, open files, processes;
- an environment of its own (PATH, HOME, LANG, PYTHON*), never the trainer's (its secrets live there);
- a verdict the program cannot forge: the jail reports the wait status it observed through a pipe the program never
  holds; what the program writes to its own event log can only name a cause, never a success (`events.py`,
  `verdict.py`);
- every descendant killed at the end: pid namespace, cgroup.kill, the slot's uid, or a process group nothing can
  leave (setsid refused), whichever is strongest here.
Without network + pid + file-system isolation it refuses to run (`SandboxRefused`) unless
`allow_weak_isolation=True` (`--agent-sandbox-allow-weak-isolation`); such runs are logged and counted in the
rollout metrics (`rollout/sandbox_weak_isolation_runs`) and carry `SandboxResult.weak_isolation`.
`SandboxLimits(allow_network=True)` drops the network isolation for a run: it shares the host's network namespace,
reaches every loopback server of the node, and, run by a non-root trainer (sockets of the trainer's uid), is let in
by the router front; logged once per process (`isolation.warn_network_run`), see docs/guides/security.md.
`HTTPSandbox` implements the same interface against a remote service that `sandbox_app` serves
(`service.py`: bearer token, the server's own maximum limits).
"""

from vime.agents.sandbox.interface import STOP_REASONS, Sandbox, SandboxLimits, SandboxRefused, SandboxResult
from vime.agents.sandbox.local import LocalSandbox, make_sandbox
from vime.agents.sandbox.service import HTTPSandbox, sandbox_app

__all__ = ["STOP_REASONS", "HTTPSandbox", "LocalSandbox", "Sandbox", "SandboxLimits", "SandboxRefused",
           "SandboxResult", "make_sandbox", "sandbox_app"]
