"""What isolation LocalSandbox can put in force on this machine, found by trying it, and what is missing.

    iso = probe_isolation(is_root=True, namespaces=True, cgroups=True)
    iso.missing()   # [] when network, pid and file-system isolation are all in force
    iso.report()    # what a run gets: namespaces, Landlock ABI, seccomp, cgroups, uids, scratch, how it is killed

Strong isolation, required unless a run is started with --agent-sandbox-allow-weak-isolation:
- network: a network namespace of its own, or a seccomp filter refusing every socket (connected UNIX pairs only);
- pid: a pid namespace with its own /proc (the trainer and other sandboxes are invisible, unsignalable);
- filesystem: Landlock (reads beneath system paths and its own directory only, writes in its directory only);
- unix_sockets: the seccomp filter, which refuses socket(AF_UNIX) (connected stream pairs only): neither Landlock
  nor a network namespace keeps a program from connecting to a path-named socket (D-Bus, docker.sock, Ray's).
The probe runs the jail in `--probe` mode inside the namespaces it means to use (`unshare`), strongest first,
so what is reported is what a run actually gets.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from vime.agents.sandbox import cgroup
from vime.agents.sandbox.interface import SandboxRefused
from vime.agents.sandbox.seccomp import machine
from vime.rollout.context import current_rollout_context

logger = logging.getLogger(__name__)
JAIL = Path(__file__).resolve().parent / "jail.py"

_USER = ("--user", "--map-root-user")
_PID = ("--fork", "--pid", "--kill-child", "--mount", "--mount-proc")
_MOUNT = ("--fork", "--kill-child", "--mount")
_NET = ("--net",)
REQUIRED = ("network", "pid", "filesystem", "unix_sockets")
WEAK_RUNS_COUNTER = "rollout/sandbox_weak_isolation_runs"


@dataclass(frozen=True)
class Isolation:
    is_root: bool
    prefix: tuple[str, ...]  # `unshare ...` argv before the jail, for runs without network
    prefix_network: tuple[str, ...]  # the same for runs with network
    user_namespace: bool
    pid_namespace: bool  # with its own /proc
    mount_namespace: bool
    net_namespace: bool
    tmpfs: bool
    masking: bool  # empty read-only tmpfs over shared directories (masking.py) in its mount namespace
    landlock_abi: int
    seccomp_arch: str  # "" when no filter can be installed
    cgroup_dir: str  # the pool's directory, "" when off
    cgroup_reason: str  # why off
    uid_range: tuple[int, int] | None  # (base, count) of the per-slot uids when root

    @property
    def kill(self) -> str:
        if self.pid_namespace:
            return "pid namespace (its pid 1 exits, the kernel kills the rest)"
        if self.cgroup_dir:
            return "cgroup.kill"
        if self.uid_range:
            return "every process of the slot's uid (kill -1 as that uid)"
        if self.seccomp_arch:
            return "process group (setsid and setpgid refused by seccomp, so nothing leaves it)"
        return "process group only: a setsid child escapes"

    @property
    def groups(self) -> str:
        """Whose supplementary groups the program keeps (they open group-readable files and sockets)."""
        if self.uid_range:
            return "none (setgroups([]) before the uid of its own)"
        kept = sorted(set(os.getgroups()) - {os.getgid()})
        if not kept:
            return "none"
        return (f"kept: gids {kept} (a user namespace made without privilege cannot drop them; "
                "start the trainer without them, e.g. setpriv --clear-groups)")

    @property
    def deny_new_session(self) -> bool:
        """Refuse setsid/setpgid only where the process group is the only sure kill."""
        return not (self.pid_namespace or self.cgroup_dir or self.uid_range)

    def missing(self) -> list[str]:
        found = {"network": self.net_namespace or bool(self.seccomp_arch), "pid": self.pid_namespace,
                 "filesystem": self.landlock_abi >= 1, "unix_sockets": bool(self.seccomp_arch)}
        return [name for name in REQUIRED if not found[name]]

    def report(self) -> dict:
        namespaces = [n for n, on in (("user", self.user_namespace), ("pid", self.pid_namespace),
                                      ("mount", self.mount_namespace), ("net", self.net_namespace)) if on]
        if self.uid_range:
            base, count = self.uid_range
            user = f"a uid of its own per running sandbox ({base}..{base + count - 1})"
        else:
            user = "a user namespace per sandbox" if self.user_namespace else "the trainer's uid (shared)"
        net = [n for n, on in (("network namespace", self.net_namespace),
                               ("seccomp: every socket refused but connected UNIX pairs",
                                bool(self.seccomp_arch))) if on]
        signals = [n for n, on in (("pid namespace: the trainer is invisible", self.pid_namespace),
                                   ("a uid of its own", bool(self.uid_range)),
                                   ("landlock scope", self.landlock_abi >= 6)) if on]
        return {
            "strong": not self.missing(),
            "missing": self.missing(),
            "user": user,
            "namespaces": namespaces,
            "network": " + ".join(net) or "none (a Python audit hook only)",
            "pid": "pid namespace with its own /proc" if self.pid_namespace else "none: shares the trainer's pids",
            "filesystem": (f"landlock abi {self.landlock_abi}: reads beneath system paths and its own directory, "
                           "writes in its directory" if self.landlock_abi else "none: file permissions only"),
            "landlock_abi": self.landlock_abi,
            "unix_sockets": ("seccomp: no socket(AF_UNIX), connected stream pairs only" if self.seccomp_arch else
                             "none: any path-named socket the uid may open is reachable"),
            "seccomp": (f"{self.seccomp_arch} filter (also ptrace, io_uring, userfaultfd, bpf, keys, mounts)"
                        if self.seccomp_arch else "unavailable"),
            "capabilities": "none (dropped and verified before the program runs)",
            "groups": self.groups,
            "cgroup": (f"memory.max and pids.max per sandbox under {self.cgroup_dir}" if self.cgroup_dir
                       else f"off: {self.cgroup_reason}"),
            "hidden": ("empty read-only tmpfs over /tmp, /var/tmp, /run, /dev/shm, /home, /root and the trainer's "
                       "home (the run's own paths bound back)" if self.masking else
                       "none: shared directories keep their names (Landlock and seccomp still refuse their use)"),
            "scratch": ("tmpfs of max_scratch_mb in a mount namespace" if self.tmpfs else
                        "RLIMIT_FSIZE per file + the directory's size checked every 0.2 s"),
            "kill": self.kill,
            "signals": " + ".join(signals) or "none: the same uid may signal the trainer",
            # the keys older callers read
            "pid_namespace": self.pid_namespace,
            "network_namespace": self.net_namespace,
            "drops_to_uid": self.uid_range[0] if self.uid_range else None,
        }


def _probe_in(prefix: tuple[str, ...]) -> dict | None:
    """Run the jail's probe inside `unshare prefix` (or directly when prefix is empty); None when that fails."""
    with tempfile.TemporaryDirectory(prefix="vime-sandbox-probe-") as scratch:
        argv = [*prefix, sys.executable, "-S", str(JAIL), "--probe", scratch, str(os.stat("/proc/self/ns/mnt").st_ino)]
        try:
            out = subprocess.run(argv, capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.TimeoutExpired):
            return None
    if out.returncode != 0:
        return None
    try:
        return json.loads(out.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _best_namespaces(is_root: bool) -> tuple[tuple[str, ...], dict]:
    """The strongest namespace set (without network) that works here, and its probe result."""
    exe = shutil.which("unshare")
    user = () if is_root else _USER
    if exe and sys.platform.startswith("linux"):
        for flags in (_PID, _MOUNT, ()):
            if not flags and not user:
                break
            found = _probe_in((exe, *user, *flags))
            if found is not None:
                return (exe, *user, *flags), found
    return (), _probe_in(()) or {}


@lru_cache(maxsize=None)
def probe_isolation(is_root: bool, namespaces: bool = True, cgroups: bool = True,
                    uid_range: tuple[int, int] | None = None) -> Isolation:
    """What runs get here; `namespaces=False` probes as if `unshare` were unavailable (a default container)."""
    base, found = _best_namespaces(is_root) if namespaces else ((), _probe_in(()) or {})
    no_network, net = base, False
    if base and _probe_in((*base, *_NET)) is not None:
        no_network, net = (*base, *_NET), True
    pool = cgroup.cgroup_pool() if cgroups else None
    reason = ("" if pool else cgroup.cgroup_reason()) if cgroups else "turned off (cgroups=False)"
    return Isolation(
        is_root=is_root, prefix=no_network, prefix_network=base, user_namespace="--user" in base,
        pid_namespace=bool(found.get("pid1") and found.get("own_proc")),
        mount_namespace=bool(found.get("mount_namespace")), net_namespace=net, tmpfs=bool(found.get("tmpfs")),
        masking=bool(found.get("mask")),
        landlock_abi=int(found.get("landlock_abi", 0)), seccomp_arch=machine() if found.get("seccomp") else "",
        cgroup_dir=pool.dir if pool else "", cgroup_reason=reason, uid_range=uid_range if is_root else None)


def refusal(missing: list[str]) -> SandboxRefused:
    fixes = {"network": "a network namespace (unshare --net) or seccomp",
             "pid": "a pid namespace with its own /proc (unshare --pid --mount-proc; as non-root with --user)",
             "filesystem": "Landlock (Linux >= 5.13 with landlock in the lsm= boot list)",
             "unix_sockets": "a seccomp filter (x86_64 or aarch64, with seccomp in the kernel)"}
    return SandboxRefused(
        f"sandbox isolation too weak to run model code: no {', no '.join(missing)} isolation here. Needs "
        + "; ".join(fixes[m] for m in missing) + ". In a container, allow unprivileged user namespaces "
        "(e.g. docker --security-opt seccomp=unconfined --security-opt apparmor=unconfined) or run it privileged; "
        "or accept the risk with --agent-sandbox-allow-weak-isolation (LocalSandbox(allow_weak_isolation=True)).")


def note_weak_run(missing: list[str]) -> None:
    """A run under weak isolation: a warning (once per kind) in the log and, inside a run, a count in its rollout
    metrics."""
    _warn_once(tuple(missing))
    context = current_rollout_context()
    if context is not None:
        context.add_counter(WEAK_RUNS_COUNTER)


@functools.cache  # once per process and kind of weakness
def _warn_once(missing: tuple[str, ...]) -> None:
    logger.warning("sandbox: running model code WITHOUT %s isolation (--agent-sandbox-allow-weak-isolation); "
                   "counted in %s", ", ".join(missing), WEAK_RUNS_COUNTER)


def warn_network_run(iso: Isolation) -> None:
    """A run with allow_network=True: what it can reach, in the log once per process."""
    _warn_network_once(bool(iso.uid_range))


@functools.cache  # once per process (and kind of uid)
def _warn_network_once(own_uid: bool) -> None:
    router = ("its sockets are its own uid's, so the router front (this user's processes only) refuses it"
              if own_uid else "its sockets are the trainer's uid's, so the router front (`router_gate`, which "
              "admits this user's processes) lets it generate with the policy")
    logger.warning("sandbox: running model code WITH network access (allow_network=True): it shares this host's "
                   "network namespace and can connect to any address the node reaches, the run's own loopback "
                   "servers and other users' included, which then stand on their own credentials alone; %s", router)
