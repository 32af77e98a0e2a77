"""Hostile programs against LocalSandbox, launched as root and as an unprivileged uid, with namespaces and without:
each way out (UNIX sockets outside, abstract sockets, the launcher's environment, home, ~/.ray and /dev/shm,
ptrace, io_uring, userfaultfd, mounts, keyrings, capabilities) is refused, and no program can forge its own verdict
(a forged exit event, malformed events, the jail's memory)."""

from __future__ import annotations

import os

import pytest

from tests.unit.test_sandbox_isolation import run_script

pytestmark = pytest.mark.skipif(not os.path.exists("/proc"), reason="LocalSandbox needs Linux")

# Run by a fresh interpreter as root or as an unprivileged uid; prints one JSON object of outcomes.
HOSTILE = r'''
import asyncio, json, os, socket, sys, tempfile, threading, time
from vime.agents.sandbox import LocalSandbox, SandboxLimits

namespaces = sys.argv[1] == "namespaces"
sandbox = LocalSandbox(namespaces=namespaces, allow_weak_isolation=True)
out = {"report": sandbox.isolation, "received": []}
tag = "vime-hostile-%d" % os.getpid()
secret = "secret-" + tag
os.environ["VIME_HOSTILE_SECRET"] = secret  # in the launcher's environment, like the trainer's tokens

# bait the permissions would let any uid read: only the sandbox stands in the way
home = tempfile.mkdtemp(prefix=tag + "-home-")
os.makedirs(os.path.join(home, ".ray"))
for path in (os.path.join(home, ".ray", "auth_token"), os.path.join(home, "notes"), "/dev/shm/" + tag):
    with open(path, "w") as f:
        f.write(secret)
    os.chmod(path, 0o644)
for d in (home, os.path.join(home, ".ray")):
    os.chmod(d, 0o755)

# listeners outside the sandbox, connectable by any uid (mode 0777): nothing may arrive
stream_path, dgram_path = "/tmp/%s.sock" % tag, "/tmp/%s.dgram" % tag
stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
stream.bind(stream_path)
stream.listen(8)
dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
dgram.bind(dgram_path)
abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
abstract.bind("\0" + tag)
abstract.listen(8)
for path in (stream_path, dgram_path):
    os.chmod(path, 0o777)
stop = threading.Event()

def listen(sock, kind):
    sock.settimeout(0.1)
    while not stop.is_set():
        try:
            if sock.type == socket.SOCK_DGRAM:
                out["received"].append([kind, sock.recv(100).decode(errors="replace")])
            else:
                conn, _ = sock.accept()
                conn.settimeout(1)
                out["received"].append([kind, "connected"])
                try:
                    out["received"].append([kind, conn.recv(100).decode(errors="replace")])
                except OSError:
                    pass
        except OSError:
            continue

threads = [threading.Thread(target=listen, args=(s, k)) for s, k in
           ((stream, "stream"), (dgram, "dgram"), (abstract, "abstract"))]
for t in threads:
    t.start()

PRELUDE = """
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
x86 = os.uname().machine == "x86_64"
out = {}
def attempt(name, fn):
    try:
        value = fn()
        out[name] = "ok" if value is None else value
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
def raw(name, number, *args):
    rc = libc.syscall(number, *args)
    out[name] = "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
def unix(address, kind=socket.SOCK_STREAM):
    s = socket.socket(socket.AF_UNIX, kind)
    s.connect(address)
    s.send(b"from the sandbox")
def pair_then(how):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    how(a)
def read(path):
    with open(path) as f:
        return "read:" + f.read()[:40]
"""
ESCAPES = PRELUDE + """
attempt("unix_stream", lambda: unix(%(stream)r))
attempt("unix_dgram", lambda: unix(%(dgram)r, socket.SOCK_DGRAM))
attempt("unix_abstract", lambda: unix("\\0" + %(tag)r))
attempt("libc_unix_socket", lambda: "fd" if libc.socket(1, 1, 0) >= 0 else errno.errorcode[ctypes.get_errno()])
attempt("pair_connect", lambda: pair_then(lambda a: a.connect(%(stream)r)))
attempt("pair_sendto", lambda: pair_then(lambda a: a.sendto(b"x", %(dgram)r)))
attempt("stat_socket", lambda: "exists" if os.stat(%(stream)r) else "")  # stat() is no Landlock right
attempt("stat_dev_shm", lambda: "exists" if os.stat("/dev/shm/" + %(tag)r) else "")
attempt("stat_home", lambda: "exists" if os.stat(%(home)r + "/.ray/auth_token") else "")
attempt("dgram_pair", lambda: [s.close() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)] and None)
attempt("environ_self", lambda: "leak" if %(secret)r in str(os.environ) else "clean")
attempt("environ_jail", lambda: read("/proc/%%d/environ" %% os.getppid()))
attempt("environ_launcher", lambda: read("/proc/%(launcher)d/environ"))
def scan():
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and %(secret)r.encode() in open("/proc/%%s/environ" %% p, "rb").read():
                return "leak:" + p
        except OSError:
            pass
    return "clean"
attempt("environ_scan", scan)
attempt("home_list", lambda: str(os.listdir(%(home)r)))
attempt("home_file", lambda: read(%(home)r + "/notes"))
attempt("ray_token", lambda: read(%(home)r + "/.ray/auth_token"))
attempt("real_home", lambda: str(os.listdir(%(real_home)r)))
attempt("root_home", lambda: str(os.listdir("/root")))
attempt("dev_shm_read", lambda: read("/dev/shm/" + %(tag)r))
attempt("dev_shm_list", lambda: str(os.listdir("/dev/shm")))
def libc_open(path, flags):  # below Python's audit hook, which would refuse first and hide the kernel's answer
    fd = libc.open(path.encode(), flags)
    if fd < 0:
        return errno.errorcode[ctypes.get_errno()]
    os.close(fd)
    return "opened"
attempt("jail_mem", lambda: libc_open("/proc/%%d/mem" %% os.getppid(), os.O_RDWR))
attempt("dev_shm_create", lambda: libc_open("/dev/shm/" + %(tag)r + "-new", os.O_WRONLY | os.O_CREAT))
raw("ptrace_attach_jail", 101 if x86 else 117, 16, os.getppid(), 0, 0)  # PTRACE_ATTACH
if out["ptrace_attach_jail"] == "ok":
    libc.syscall(101 if x86 else 117, 17, os.getppid(), 0, 0)  # PTRACE_DETACH: an old sandbox let it in
raw("process_vm_readv_jail", 310 if x86 else 270, os.getppid(), 0, 0, 0, 0, 0)
params = ctypes.create_string_buffer(120)
raw("io_uring_setup", 425, 4, params)
raw("userfaultfd", 323 if x86 else 282, 1)  # UFFD_USER_MODE_ONLY: allowed to any user where not filtered
raw("keyctl", 250 if x86 else 219, 0, -4, 0)  # KEYCTL_GET_KEYRING_ID of the user keyring (shared by the uid)
raw("bpf", 321 if x86 else 280, 0, 0, 0)
os.mkdir("m")
raw("mount", 165 if x86 else 40, b"none", b"m", b"tmpfs", 0, None)
raw("umount_scratch", 166 if x86 else 39, os.getcwd().encode(), 2)  # MNT_DETACH of its own scratch
attempt("capabilities", lambda: [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0])
attempt("groups", lambda: sorted(set(os.getgroups()) - {os.getgid()}))
print(json.dumps(out))
""" % {"stream": stream_path, "dgram": dgram_path, "tag": tag, "secret": secret, "home": home,
       "launcher": os.getpid(), "real_home": os.environ.get("HOME", "/root")}

FORGERIES = {
    # the events file the program can write: an exit event of either form, then exit 1
    "forged_exit": "import json, os\nwith open(os.environ['VIME_SANDBOX_EVENTS'], 'a') as f:\n"
                   "    f.write(json.dumps({'event': 'exit', 'signal': 0}) + '\\n')\n"
                   "    f.write(json.dumps({'event': 'exit', 'status': 0}) + '\\n')\nraise SystemExit(1)",
    "malformed_events": "import os\nwith open(os.environ['VIME_SANDBOX_EVENTS'], 'a') as f:\n"
                        "    f.write('[1]\\n{\"event\": \"violation\"}\\n{\"event\": \"exit\", \"signal\": \"x\"}\\n')",
    # a program that kills its jail (which reports its exit) and then fails: never read as a success
    "kill_jail": "import os, signal, time\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n"
                 "    pass\ntime.sleep(0.2)\nraise SystemExit(3)",
}

async def main():
    limits = SandboxLimits(wall_time_s=10)
    r = await sandbox.run(code=ESCAPES, limits=limits)
    try:
        out["escapes"] = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out["escapes"] = {"stdout": r.stdout[-500:], "stderr": r.stderr[-1500:]}
    r = await sandbox.run(code=ESCAPES, limits=SandboxLimits(wall_time_s=10, allow_network=True))
    try:
        out["escapes_network"] = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out["escapes_network"] = {"stdout": r.stdout[-500:], "stderr": r.stderr[-1500:]}
    for name, code in FORGERIES.items():
        try:
            r = await sandbox.run(code=code, limits=limits)
            out[name] = {"ok": r.ok, "exit_code": r.exit_code, "reason": r.stopped_reason}
        except Exception as e:  # what an old sandbox did with a malformed event
            out[name] = {"raised": type(e).__name__ + ": " + str(e)}

asyncio.run(main())
time.sleep(0.3)
stop.set()
for t in threads:
    t.join()
for path in (stream_path, dgram_path, "/dev/shm/" + tag, "/dev/shm/" + tag + "-new"):
    if os.path.exists(path):
        os.unlink(path)
__import__("shutil").rmtree(home)
print(json.dumps(out))
'''

REFUSED = {"EPERM", "EACCES", "ENOENT", "ESRCH", "EROFS"}


def _check_escapes(esc: dict, namespaces: bool) -> None:
    for name in ("unix_stream", "unix_dgram", "unix_abstract", "libc_unix_socket", "dgram_pair", "io_uring_setup",
                 "userfaultfd", "keyctl", "bpf", "ptrace_attach_jail", "process_vm_readv_jail", "mount"):
        assert esc[name] == "EPERM", (name, esc)
    # a connected pair works, and cannot be pointed anywhere else (nor find the name, where it is hidden)
    assert esc["pair_connect"] in ("EISCONN", "ENOENT"), esc
    assert esc["pair_sendto"] in ("EISCONN", "EOPNOTSUPP", "ENOENT"), esc
    assert esc["environ_self"] == esc["environ_scan"] == "clean", esc
    for name in ("environ_jail", "environ_launcher", "home_list", "home_file", "ray_token", "real_home",
                 "root_home", "dev_shm_read", "dev_shm_list", "jail_mem", "dev_shm_create", "umount_scratch"):
        assert esc[name] in REFUSED, (name, esc)
    if namespaces:  # its own /proc: the launcher is not even there; /tmp, /dev/shm and home are empty
        assert esc["environ_launcher"] == "ENOENT", esc
        assert esc["stat_socket"] == esc["stat_dev_shm"] == esc["stat_home"] == "ENOENT", esc
    assert esc["capabilities"] == "0000000000000000", esc


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "degraded"])
@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_hostile_programs_are_refused_and_cannot_forge_their_result(as_user, namespaces):
    out = run_script(HOSTILE, ["namespaces" if namespaces else "degraded"], as_user, timeout=180)
    report = out["report"]
    if namespaces and report["missing"]:
        pytest.skip(f"no full isolation here: {report['missing']}")
    assert out["received"] == [], out["received"]  # nothing reached a listener outside
    assert out["forged_exit"] == {"ok": False, "exit_code": 1, "reason": "tampering"}, out["forged_exit"]
    assert out["malformed_events"] == {"ok": False, "exit_code": 0, "reason": "tampering"}, out["malformed_events"]
    # pid 1 of a pid namespace ignores the SIGKILL and reports exit 3; a killed jail is a sandbox_error
    assert out["kill_jail"] in ({"ok": False, "exit_code": 3, "reason": None},
                                {"ok": False, "exit_code": -9, "reason": "sandbox_error"}), out["kill_jail"]
    _check_escapes(out["escapes"], namespaces)
    _check_escapes(out["escapes_network"], namespaces)  # network allowed: still no UNIX socket, no io_uring
    # what the sandbox says it does
    assert "unix_sockets" not in report["missing"] and report["unix_sockets"].startswith("seccomp"), report
    assert report["capabilities"].startswith("none") and report["groups"].startswith("none"), report
    assert report["hidden"].startswith("empty read-only tmpfs" if namespaces else "none"), report
