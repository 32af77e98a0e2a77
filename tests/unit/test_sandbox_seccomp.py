"""The seccomp filter: sockets other than AF_UNIX, new namespaces and (when asked) new sessions are refused, in a
real process that installed it; everything else a program needs still works."""

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
    assert out["unix"] == out["socketpair"] == "ok", out
    assert out["unshare_user"] == "EPERM" and out["setsid"] == "EPERM", out
    assert out["subprocess"] == "hi" and out["thread"] == "ok" and out["fork"] == 7, out


def test_filter_keeps_what_was_not_asked_for():
    out = _probe(deny_network=False, deny_new_session=False)
    assert out["inet"] == out["inet6"] == out["libc_socket"] == "ok", out
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
