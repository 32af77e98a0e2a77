"""The seccomp filter: sockets but connected AF_UNIX pairs, new namespaces, other processes' memory, io_uring,
userfaultfd, keys, mounts and (when asked) new sessions are refused, in a real process that installed it;
everything else a program needs still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.agents.sandbox.seccomp import ARCHES, build_filter, encode, machine

pytestmark = pytest.mark.skipif(machine() not in ARCHES or not sys.platform.startswith("linux"),
                                reason=f"no seccomp filter for {machine()}")
REPO = Path(__file__).resolve().parents[2]

PROBE = r'''
import ctypes, errno, json, os, socket, subprocess, sys, threading
from vime.agents.sandbox.seccomp import build_filter, install, machine

install(build_filter(machine(), deny_network=sys.argv[1] == "1", deny_new_session=sys.argv[2] == "1"))
libc = ctypes.CDLL(None, use_errno=True)
out = {}

def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode[e.errno]

attempt("inet", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
attempt("inet6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close())
attempt("unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close())
attempt("socketpair", lambda: [s.close() for s in socket.socketpair()])
attempt("socketpair_seqpacket", lambda: [s.close() for s in socket.socketpair(type=socket.SOCK_SEQPACKET)])
attempt("socketpair_dgram", lambda: [s.close() for s in socket.socketpair(type=socket.SOCK_DGRAM)])
attempt("unix_nonblock", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK).close())
libc.syscall.restype = ctypes.c_long

def raw(name, number, *args):
    out[name] = "ok" if libc.syscall(number, *args) >= 0 else errno.errorcode[ctypes.get_errno()]

x86 = machine() == "x86_64"
buf = ctypes.create_string_buffer(128)
# each call is harmless where it is not filtered (this test also runs against filters that miss some):
# a pid that cannot exist, a mount point that does not, nothing traced
raw("ptrace_peek", 101 if x86 else 117, 2, 2**22 + 1, 0, 0)  # PTRACE_PEEKDATA of no process: ESRCH unfiltered
raw("process_vm_readv", 310 if x86 else 270, 2**22 + 1, 0, 0, 0, 0, 0)
raw("io_uring_setup", 425, 4, buf)
raw("userfaultfd", 323 if x86 else 282, 0)
raw("keyctl_get_keyring_id", 250 if x86 else 219, 0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring
raw("bpf", 321 if x86 else 280, 0, 0, 0)
raw("mount", 165 if x86 else 40, b"none", b"/nonexistent-vime-seccomp-probe", b"tmpfs", 0, None)
raw("fsopen", 430, b"tmpfs", 0)
out["libc_socket"] = "ok" if libc.socket(2, 1, 0) >= 0 else errno.errorcode[ctypes.get_errno()]
out["unshare_user"] = "ok" if libc.unshare(0x10000000) == 0 else errno.errorcode[ctypes.get_errno()]
attempt("setsid", os.setsid)  # this process is no group leader, so setsid would succeed unfiltered
out["subprocess"] = subprocess.run(["echo", "hi"], capture_output=True, text=True).stdout.strip()
t = threading.Thread(target=lambda: out.setdefault("thread", "ok"))
t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.WEXITSTATUS(os.waitpid(pid, 0)[1])
print(json.dumps(out))
'''


def _probe(deny_network: bool, deny_new_session: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(int(deny_network)), str(int(deny_new_session))],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_filter_refuses_network_namespaces_and_sessions():
    out = _probe(deny_network=True, deny_new_session=True)
    assert out["inet"] == out["inet6"] == out["libc_socket"] == "EPERM", out
    _assert_always_refused(out)
    assert out["unshare_user"] == "EPERM" and out["setsid"] == "EPERM", out
    assert out["subprocess"] == "hi" and out["thread"] == "ok" and out["fork"] == 7, out


def _assert_always_refused(out: dict) -> None:
    """With or without network: no UNIX socket that could connect anywhere, no other process, no rare kernel doors."""
    assert out["unix"] == out["unix_nonblock"] == out["socketpair_dgram"] == "EPERM", out
    assert out["socketpair"] == out["socketpair_seqpacket"] == "ok", out  # asyncio, multiprocessing
    for name in ("ptrace_peek", "process_vm_readv", "io_uring_setup", "userfaultfd", "keyctl_get_keyring_id",
                 "bpf", "mount", "fsopen"):
        assert out[name] == "EPERM", (name, out)


def test_filter_keeps_what_was_not_asked_for():
    out = _probe(deny_network=False, deny_new_session=False)
    assert out["inet"] == out["inet6"] == out["libc_socket"] == "ok", out
    _assert_always_refused(out)
    assert out["setsid"] == "ok", out
    assert out["unshare_user"] == "EPERM", out  # new namespaces are always refused


def test_filter_checks_the_architecture_first():
    prog = build_filter("x86_64", deny_network=True, deny_new_session=False)
    load_arch, check_arch, kill = prog[:3]
    assert load_arch == (0x20, 0, 0, 4)  # A = seccomp_data.arch
    assert check_arch == (0x15, 1, 0, 0xC000003E)  # x86_64: skip the kill; anything else (i386 calls): kill
    assert kill == (0x06, 0, 0, 0x80000000)
    assert len(encode(prog)) == 8 * len(prog)
    with pytest.raises(ValueError, match="no seccomp filter for architecture"):
        build_filter("mips", True, True)
