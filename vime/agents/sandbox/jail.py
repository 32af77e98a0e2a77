"""Inside a LocalSandbox: join the cgroup, mount the scratch, set limits, drop privileges, restrict, run and reap.

Run as `python -S jail.py CONFIG.json` by LocalSandbox, usually as pid 1 of fresh pid, mount and network
namespaces made by `unshare`. Standard library only, no site packages: it runs before any sandboxed code.
Every isolation step the config asks for must succeed, or the program is not run at all (exit 126 and an
`isolation_error` event): LocalSandbox asks only for what its probe found working here, so a failure is a
surprise, never a reason to run with less.
It forks the program, waits for it and exits with its status; when pid 1 exits the kernel kills every process
left in the pid namespace. Without one, a jail that runs as a uid of its own kills every process of that uid.

What the jail reports (isolation, isolation_error, the program's wait status) goes to LocalSandbox through a pipe
(`status_fd`) that is close-on-exec here: the program never holds it, nothing names it in its environment, and it
cannot reach the jail's descriptors or memory (the jail is not dumpable, the program has no capabilities and
seccomp refuses ptrace and pidfd_getfd). So the program cannot forge the verdict on itself.

`python -S jail.py --probe DIR MNT_NS`: what works here (pid 1, own /proc, tmpfs, Landlock, seccomp), as
JSON on stdout; LocalSandbox runs it once inside the namespaces it means to use.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import socket
import sys

import landlock  # beside this file (sys.path[0])
import masking
import seccomp

_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS = 4, 24, 28
# SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_NO_CAP_AMBIENT_RAISE set and locked, SECBIT_KEEP_CAPS (unset)
# locked: uid 0 (root in a user namespace of its own) gains no capabilities at exec, now or ever
_SECUREBITS_NO_CAPS = 0b1 | 0b10 | 0b100 | 0b1000 | 0b100000 | 0b1000000 | 0b10000000
_CAP_VERSION_3 = 0x20080522


class IsolationError(Exception):
    pass


def _event(fd: int, **fields) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


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


def in_new_mount_namespace(parent_mnt_ns: int) -> bool:
    """Mounting is only ever done in a mount namespace of our own, never in the trainer's."""
    return os.stat("/proc/self/ns/mnt").st_ino != parent_mnt_ns


def mount_tmpfs(target: str, options: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", target.encode(), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV),
                  options.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount tmpfs on {target}")


def _step(name: str, fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except (OSError, ValueError) as e:
        raise IsolationError(f"{name}: {e}") from e


def _join_cgroup(path: str) -> None:
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write("0\n")


def _scratch(cfg: dict) -> None:
    """The program's directory: a size-limited tmpfs holding copies of its files."""
    tmpfs, work = cfg["tmpfs"], cfg["cwd"]
    if not in_new_mount_namespace(cfg["parent_mnt_ns"]):
        raise IsolationError("tmpfs: not in a mount namespace of its own; refusing to mount")
    owner = f",uid={cfg['uid']},gid={cfg['gid']}" if cfg.get("uid") is not None else ""
    _step("tmpfs", mount_tmpfs, work, f"size={tmpfs['size_mb']}m,nr_inodes={tmpfs['nr_inodes']},mode=0700{owner}")
    _step("tmpfs files", shutil.copytree, cfg["stage"], work, dirs_exist_ok=True)
    if cfg.get("uid") is not None:
        for base, dirs, files in os.walk(work):
            for name in dirs + files:
                os.chown(os.path.join(base, name), cfg["uid"], cfg["gid"], follow_symlinks=False)


def _drop_privileges(cfg: dict) -> None:
    os.setgroups([])
    os.setgid(cfg["gid"])
    os.setuid(cfg["uid"])
    if os.getuid() != cfg["uid"] or os.geteuid() != cfg["uid"]:
        raise IsolationError(f"setuid({cfg['uid']}) did not take")


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def capabilities() -> dict[str, int]:
    """This process's capability sets from /proc (CapInh, CapPrm, CapEff, CapBnd, CapAmb)."""
    with open("/proc/self/status") as f:
        return {k: int(v, 16) for k, v in (line.split(":", 1) for line in f) if k.startswith("Cap")}


def drop_capabilities() -> None:
    """No capabilities now or after exec. Root in a user namespace of its own (the non-root case) holds every
    capability inside it: ptrace of the jail, mounts, raw sockets. Verified, or IsolationError."""
    caps = capabilities()
    if caps["CapPrm"] or caps["CapEff"] or caps["CapAmb"]:
        libc = _libc()
        cap = 0
        while libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the last capability
            cap += 1
        if libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS_NO_CAPS, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECUREBITS)")
        header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
        data = (ctypes.c_uint32 * 6)()  # two (effective, permitted, inheritable) triples, all empty
        if libc.capset(header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    left = {k: v for k, v in capabilities().items() if k != "CapBnd" and v}
    if left:
        raise IsolationError(f"capabilities left after dropping them: {left}")


def isolate(cfg: dict) -> dict:
    """Every step the config asks for, in order; returns what was applied (the `isolation` event)."""
    applied = {}
    if cfg.get("cgroup"):
        _step("cgroup", _join_cgroup, cfg["cgroup"])
        applied["cgroup"] = cfg["cgroup"]
    if cfg.get("mask"):  # before the scratch: its tmpfs then lands on the bound-back run directory
        if not in_new_mount_namespace(cfg["parent_mnt_ns"]):
            raise IsolationError("mask: not in a mount namespace of its own; refusing to mount")
        applied["hidden"] = _step("mask", masking.mask_directories, cfg["mask"]["dirs"], cfg["mask"]["keep"])
    if cfg.get("tmpfs"):
        _scratch(cfg)
        applied["scratch"] = f"tmpfs {cfg['tmpfs']['size_mb']} MiB"
    limits = cfg["rlimits"]
    for name, value in limits.items():
        if name != "NPROC" and value is not None:
            # CPU: SIGXCPU at the limit, SIGKILL a second later (equal limits would SIGKILL first: no "timeout")
            hard = value + 1 if name == "CPU" else value
            _step(f"rlimit {name}", resource.setrlimit, getattr(resource, "RLIMIT_" + name), (value, hard))
    if cfg.get("uid") is not None:  # started as root: a uid of this slot's own, so RLIMIT_NPROC holds per sandbox
        _step("uid", _drop_privileges, cfg)
        applied["uid"] = cfg["uid"]
    _step("capabilities", drop_capabilities)
    applied["capabilities"] = "none"
    if limits.get("NPROC") is not None:
        nproc = limits["NPROC"]
        if cfg.get("nproc_shared"):  # no uid or user namespace of its own: the count is shared with the user
            nproc += tasks_of_user(os.getuid())
        _step("rlimit NPROC", resource.setrlimit, resource.RLIMIT_NPROC, (nproc, nproc))
    if cfg.get("landlock"):
        ll = cfg["landlock"]
        applied["landlock"] = _step("landlock", landlock.restrict, ll["read"], ll["write"], ll["deny_tcp"])
    if cfg.get("seccomp"):
        sc = cfg["seccomp"]
        _step("seccomp", seccomp.install,
              seccomp.build_filter(sc["arch"], sc["deny_network"], sc["deny_new_session"]))
        applied["seccomp"] = sc
    return applied


def _run_and_reap(cfg: dict) -> int:
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
            return 1 << 8
        if waited == pid:
            return status


def main(config_path: str) -> None:
    with open(config_path) as f:
        cfg = json.load(f)
    events = cfg["status_fd"]
    os.set_inheritable(events, False)  # the program must never hold the channel that reports on it
    _libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # nor read or write this process through /proc or ptrace
    try:
        applied = isolate(cfg)
    except Exception as e:  # noqa: BLE001  (whatever went wrong, the program must not run with less)
        os.write(2, f"sandbox: isolation failed, the program was not run: {e}\n".encode())
        _event(events, event="isolation_error", message=str(e))
        sys.exit(126)
    _event(events, event="isolation", **applied)
    status = _run_and_reap(cfg)
    if cfg.get("kill_uid_at_exit") and cfg.get("uid") is not None:
        # no pid namespace: a uid of its own finds every descendant, setsid or not
        try:
            os.kill(-1, signal.SIGKILL)  # every process this uid may signal, i.e. its own, but not this one
        except ProcessLookupError:
            pass
    _event(events, event="exit", status=status)  # the wait status the jail itself observed
    if os.WIFSIGNALED(status):
        sys.exit(128 + os.WTERMSIG(status))
    sys.exit(os.WEXITSTATUS(status))


def _refused(family: int) -> bool:
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
    except PermissionError:
        return True
    return False


def _seccomp_works() -> bool:
    """Install the filter in a child and see an inet and a UNIX socket refused there (it cannot be taken off)."""
    pid = os.fork()
    if pid == 0:
        try:
            seccomp.install(seccomp.build_filter(seccomp.machine(), True, False))
            os._exit(0 if _refused(socket.AF_INET) and _refused(socket.AF_UNIX) else 1)
        except BaseException:
            os._exit(2)
    return os.waitpid(pid, 0)[1] == 0


def _masking_works(scratch_dir: str) -> bool:
    """Hide a directory keeping one path beneath it, and see exactly that path left."""
    outer = os.path.join(scratch_dir, "outer")
    os.makedirs(os.path.join(outer, "keep"))
    os.makedirs(os.path.join(outer, "other"))
    try:
        masking.mask_directories([outer], [os.path.join(outer, "keep")])
    except OSError:
        return False
    return os.listdir(outer) == ["keep"]


def probe(scratch_dir: str, parent_mnt_ns: int) -> dict:
    found = {"pid1": os.getpid() == 1, "own_proc": os.readlink("/proc/self") == str(os.getpid()),
             "mount_namespace": in_new_mount_namespace(parent_mnt_ns), "tmpfs": False,
             "landlock_abi": landlock.abi(), "seccomp": False, "mask": False}
    if found["mount_namespace"]:
        try:
            mount_tmpfs(scratch_dir, "size=1m,mode=0700")
            found["tmpfs"] = True
            found["mask"] = _masking_works(scratch_dir)
        except OSError:
            pass
    try:
        found["seccomp"] = _seccomp_works()
    except (OSError, ValueError):
        pass
    return found


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        print(json.dumps(probe(sys.argv[2], int(sys.argv[3]))))
    else:
        main(sys.argv[1])
