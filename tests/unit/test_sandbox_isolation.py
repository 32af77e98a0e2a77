"""What LocalSandbox isolates, with namespaces and without (a default container): it refuses weak isolation unless
allowed, and then still blocks the network below Python, signals to the trainer, its private files, and kills a
`setsid` child. Each check runs as root and as an unprivileged user (a subprocess that drops to another uid)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from vime.agents.sandbox import LocalSandbox, SandboxLimits, SandboxRefused, make_sandbox
from vime.agents.sandbox import isolation as sandbox_isolation
from vime.rollout.context import reset_rollout_context
from vime.rollout.metrics import take_counters

pytestmark = pytest.mark.skipif(not os.path.exists("/proc"), reason="LocalSandbox needs Linux")
REPO = Path(__file__).resolve().parents[2]

# Run by a fresh interpreter as root or as an unprivileged uid; prints one JSON object of outcomes.
ESCAPES = r'''
import asyncio, errno, json, os, socket, subprocess, sys, tempfile, time
from vime.agents.sandbox import LocalSandbox, SandboxLimits, SandboxRefused
from vime.agents.sandbox import isolation as sandbox_isolation

namespaces = sys.argv[1] == "namespaces"
out = {}
try:
    asyncio.run(LocalSandbox(namespaces=namespaces).run(code="print(1)"))
    out["refused"] = None
except SandboxRefused as e:
    out["refused"] = str(e)
sandbox = LocalSandbox(namespaces=namespaces, allow_weak_isolation=True)
out["missing"] = sandbox.isolation["missing"]
out["hidden"] = sandbox.isolation["hidden"]
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(4)
listener.settimeout(0.2)
port = listener.getsockname()[1]
private = tempfile.mkdtemp()
os.chmod(private, 0o755)  # another uid may pass; only the file's own mode protects it
secret = os.path.join(private, "secret")
with open(secret, "w") as f:
    f.write("trainer secret")
os.chmod(secret, 0o600)
sibling = subprocess.Popen(["sleep", "60"])
marker = "300.%d" % os.getpid()  # a sleep the program starts in a session of its own, found by its argument
limits = SandboxLimits(wall_time_s=5)

def errno_of(call):
    return "try:\n    %s\n    print('ok')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])" % call

programs = {
    "ctypes_connect": "import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                      "fd = libc.socket(2, 1, 0)\nprint(errno.errorcode[ctypes.get_errno()] if fd < 0 else 'socket')",
    "kill_parent": "import errno, os\n" + errno_of("os.kill(%d, 0)" % os.getpid()),
    "kill_sibling": "import errno, os\n" + errno_of("os.kill(%d, 9)" % sibling.pid),
    "read_private": "import errno\n" + errno_of("open(%r).read()" % secret),
    "read_environ": "import errno\n" + errno_of("open('/proc/%d/environ').read()" % os.getpid()),
    "setsid_child": "import subprocess, time\nsubprocess.Popen(['setsid', 'sleep', %r])\ntime.sleep(0.3)\nprint('ok')"
                    % marker,
}

async def main():
    for name, code in programs.items():
        r = await sandbox.run(code=code, limits=limits)
        out[name] = {"stdout": r.stdout.strip(), "reason": r.stopped_reason, "stderr": r.stderr[-300:]}
    r = await sandbox.run(command=["bash", "-c", "echo x >/dev/tcp/127.0.0.1/%d && echo connected" % port],
                          limits=limits)
    out["bash_dev_tcp"] = {"stdout": r.stdout.strip(), "reason": r.stopped_reason, "stderr": r.stderr[-300:]}

asyncio.run(main())
try:
    listener.accept()
    out["listener_connected"] = True
except socket.timeout:
    out["listener_connected"] = False
time.sleep(0.2)

def alive(pid):
    try:
        with open("/proc/%s/status" % pid) as f:
            return "\nState:\tZ" not in f.read()
    except OSError:
        return False

survivors = []
for p in os.listdir("/proc"):
    try:
        with open("/proc/%s/cmdline" % p, "rb") as f:
            if marker.encode() in f.read() and alive(p):
                survivors.append(p)
    except OSError:
        pass
out["setsid_survivors"] = survivors
out["sibling_alive"] = sibling.poll() is None
sibling.kill()
print(json.dumps(out))
'''


def _unused_uid() -> int:
    for uid in range(54321, 54400):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise RuntimeError("no unused uid in 54321..54399")


def _world_python() -> str | None:
    """An interpreter an unprivileged uid may run (this one may live under /root)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = Path(os.path.realpath(candidate))
        if real.exists() and all(p.stat().st_mode & 0o001 for p in [real, *real.parents]):
            return candidate
    return None


def run_script(script: str, args: list[str], as_user: bool, timeout: int = 120) -> dict:
    """Run `script` in a fresh interpreter (as an unprivileged uid when `as_user`); its last stdout line as JSON."""
    kwargs: dict = {}
    python = sys.executable
    if as_user and os.geteuid() == 0:
        python = _world_python()
        if python is None:
            pytest.skip("no Python interpreter here that an unprivileged uid may run")
        if not all(p.stat().st_mode & 0o005 == 0o005 for p in [REPO, *REPO.parents]):
            pytest.skip(f"{REPO} is not readable by other users")
        uid = _unused_uid()
        kwargs = {"user": uid, "group": uid, "extra_groups": []}
    elif not as_user and os.geteuid() != 0:
        pytest.skip("needs root")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/tmp", "LANG": "C.UTF-8"}
    proc = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd="/tmp", **kwargs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_degraded_sandbox_refuses_then_still_blocks_escapes(as_user):
    """No namespaces (as in a default container): refused without the flag; with it, each escape is blocked."""
    out = run_script(ESCAPES, ["degraded"], as_user)
    assert out["missing"] == ["pid"], out  # seccomp stands in for the network namespace, Landlock is there
    assert "--agent-sandbox-allow-weak-isolation" in out["refused"] and "no pid isolation" in out["refused"]
    assert out["ctypes_connect"]["stdout"] == "EPERM"  # seccomp: socket(AF_INET) below any Python hook
    assert out["bash_dev_tcp"]["reason"] == "network" and "connected" not in out["bash_dev_tcp"]["stdout"]
    assert "socket: Operation not permitted" in out["bash_dev_tcp"]["stderr"]
    assert not out["listener_connected"]
    # another uid (root) or Landlock's signal scope (a user): the trainer and its other processes are out of reach
    assert out["kill_parent"]["stdout"] == "EPERM" and out["kill_sibling"]["stdout"] == "EPERM"
    assert out["sibling_alive"]
    assert out["read_private"]["stdout"] == "EACCES" and out["read_environ"]["stdout"] == "EACCES"
    assert out["setsid_survivors"] == []
    if as_user and os.geteuid() == 0 or os.geteuid() != 0:  # the same uid: setsid is refused (seccomp)
        assert "setsid failed: Operation not permitted" in out["setsid_child"]["stderr"], out["setsid_child"]
    else:  # a uid of its own: the child ran, and was killed with every other process of that uid
        assert out["setsid_child"]["stdout"] == "ok" and not out["setsid_child"]["stderr"], out["setsid_child"]


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_full_sandbox_blocks_escapes(as_user):
    out = run_script(ESCAPES, ["namespaces"], as_user)
    if out["missing"]:
        pytest.skip(f"no full isolation here ({out['missing']}): {out['refused']}")
    assert out["refused"] is None
    assert out["ctypes_connect"]["stdout"] == "EPERM"
    assert out["bash_dev_tcp"]["reason"] == "network" and not out["listener_connected"]
    assert out["kill_parent"]["stdout"] == "ESRCH" and out["kill_sibling"]["stdout"] == "ESRCH"  # invisible
    assert out["read_environ"]["stdout"] == "ENOENT"  # its own /proc has no trainer in it
    # its /tmp is an empty tmpfs where a mount namespace allows; Landlock refuses the read in any case
    assert out["read_private"]["stdout"] == ("ENOENT" if out["hidden"].startswith("empty") else "EACCES")
    assert out["sibling_alive"] and out["setsid_survivors"] == []


def test_isolation_report_and_refusal_in_process():
    weak = LocalSandbox(namespaces=False)
    report = weak.isolation
    assert not report["strong"] and "pid" in report["missing"] and report["namespaces"] == []
    assert report["pid_namespace"] is False and report["scratch"].startswith("RLIMIT_FSIZE")
    for key in ("user", "network", "filesystem", "landlock_abi", "seccomp", "cgroup", "kill", "signals"):
        assert key in report
    with pytest.raises(SandboxRefused, match="allow-weak-isolation"):
        asyncio.run(weak.run(code="print(1)"))
    with pytest.raises(SandboxRefused, match="no pid isolation"):
        weak.check_isolation()
    if LocalSandbox().isolation["missing"]:  # make_sandbox checks at once
        with pytest.raises(SandboxRefused):
            make_sandbox("local")
    else:
        assert make_sandbox("local").isolation["strong"]
    assert make_sandbox("local", allow_weak_isolation=True).allow_weak_isolation


def test_weak_run_is_logged_and_counted(caplog, monkeypatch):
    sandbox_isolation._warn_once.cache_clear()  # warned once per process: earlier tests may have
    reset_rollout_context()
    sandbox = LocalSandbox(namespaces=False, allow_weak_isolation=True)
    with caplog.at_level(logging.WARNING):
        results = [asyncio.run(sandbox.run(code="print(1)", limits=SandboxLimits(wall_time_s=5))) for _ in range(2)]
    assert all(r.ok and r.weak_isolation == ["pid"] for r in results)
    assert take_counters()["rollout/sandbox_weak_isolation_runs"] == 2.0
    assert any("WITHOUT pid isolation" in m for m in caplog.messages)
    assert any(m.startswith("sandbox isolation: ") and '"strong": false' in m for m in caplog.messages)


def test_network_runs_do_not_count_as_weak():
    """A run that asks for the network gets it (no seccomp socket rule) and is not missing network isolation."""
    sandbox = LocalSandbox(allow_weak_isolation=True)
    r = asyncio.run(sandbox.run(code="import socket\nsocket.socket().close()\nprint('socket')",
                                limits=SandboxLimits(wall_time_s=5, allow_network=True)))
    assert r.ok and r.stdout == "socket\n" and "network" not in r.weak_isolation, r


NETWORK_WARNING = r'''
import asyncio, json, logging
from vime.agents.sandbox import LocalSandbox, SandboxLimits

warned = []
handler = logging.Handler()
handler.emit = lambda record: warned.append(record.getMessage())
logging.getLogger("vime.agents.sandbox").addHandler(handler)
sandbox = LocalSandbox(allow_weak_isolation=True)
network = SandboxLimits(wall_time_s=5, allow_network=True)
results = [asyncio.run(sandbox.run(code="print(1)", limits=limits))
           for limits in (network, network, SandboxLimits(wall_time_s=5))]
print(json.dumps({"ok": all(r.ok for r in results), "own_uid": bool(sandbox.isolation["drops_to_uid"]),
                  "warned": [m for m in warned if "allow_network=True" in m]}))
'''


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_network_runs_are_warned_about_what_they_reach(as_user):
    """allow_network=True shares the host's network namespace: the log says so, once, and whether the router front
    refuses the program (as root: a uid of its own) or admits it (as a user: its sockets are the trainer's uid's)."""
    out = run_script(NETWORK_WARNING, [], as_user)
    assert out["ok"] and len(out["warned"]) == 1, out
    warned = out["warned"][0]
    assert "shares this host's network namespace" in warned and out["own_uid"] == (os.geteuid() == 0 and not as_user)
    assert ("router front (this user's processes only) refuses it" in warned) == out["own_uid"], warned
    assert ("lets it generate with the policy" in warned) == (not out["own_uid"]), warned


@pytest.mark.skipif(os.geteuid() != 0, reason="uid slots are for root")
def test_setsid_child_of_a_timed_out_run_is_killed_without_namespaces():
    """At the wall time the jail itself is killed; the slot's uid still finds the child that left its session."""
    marker = f"300.{os.getpid()}"
    sandbox = LocalSandbox(namespaces=False, allow_weak_isolation=True)
    r = asyncio.run(sandbox.run(command=f"setsid sleep {marker} & while true; do :; done",
                                limits=SandboxLimits(wall_time_s=1)))
    assert r.stopped_reason == "timeout" and r.duration_s < 4, r  # the pipes closed: nothing held them open
    survivors = []
    for entry in Path("/proc").iterdir():
        try:
            alive = "\nState:\tZ" not in (entry / "status").read_text()
            if marker.encode() in (entry / "cmdline").read_bytes() and alive:
                survivors.append(entry.name)
        except OSError:
            continue
    assert survivors == []


def test_without_seccomp_unix_sockets_are_missing_and_refused(monkeypatch):
    """Neither Landlock nor a network namespace stops connect() to a path-named socket: no filter, no strong run."""
    iso = sandbox_isolation.probe_isolation(os.geteuid() == 0)
    no_filter = dataclasses.replace(iso, seccomp_arch="", net_namespace=True, pid_namespace=True, landlock_abi=6)
    assert no_filter.missing() == ["unix_sockets"]
    report = no_filter.report()
    assert not report["strong"] and report["unix_sockets"].startswith("none: any path-named socket")
    with pytest.raises(SandboxRefused, match="no unix_sockets isolation.*seccomp filter"):
        raise sandbox_isolation.refusal(no_filter.missing())
    as_user = dataclasses.replace(no_filter, uid_range=None)
    monkeypatch.setattr(os, "getgroups", lambda: [os.getgid(), 998, 999])
    assert as_user.report()["groups"].startswith("kept: gids [998, 999]")
    monkeypatch.setattr(os, "getgroups", lambda: [os.getgid()])
    assert as_user.report()["groups"] == "none"
    assert dataclasses.replace(iso, uid_range=(2**30, 4)).report()["groups"].startswith("none (setgroups")
