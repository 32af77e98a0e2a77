"""vllm-router's Prometheus endpoint: off unless --router-prometheus-port asks for it.

vllm-router 0.1.17 serves Prometheus metrics whatever it is told: given no port its Python binding still starts the
exporter (on 29000), and it panics when the exporter cannot bind. The exporter answers anyone who connects, with
the engines' URLs and the request counts. So vime gives it a free loopback port and then closes that port to
everyone, from a helper process that shares the router's file-descriptor table (`clone(CLONE_FILES)`: the router's
`start()` holds the GIL, so no thread of the router's own process could do it). As soon as the exporter listens,
the helper attaches a drop-everything socket filter to its socket (a connection attempt gets no answer), and shuts
any connection made before that. If it cannot, it kills the router, whose log then says how to serve the metrics
on purpose.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import signal
import socket
import struct
import sys
import time

from vime.utils.listeners import hex_address, tcp_sockets

CLONE_FILES = 0x400  # the child shares the parent's file-descriptor table
SYS_CLONE = {"x86_64": 56, "aarch64": 220}  # clone(2)'s number: Python has no wrapper that takes flags
SO_ATTACH_FILTER = 26
DROP_EVERYTHING = struct.pack("=HBBI", 0x06, 0, 0, 0)  # classic BPF `ret #0`: keep no byte of any packet
LISTEN, ESTABLISHED = "0A", "01"  # TCP states as /proc/net/tcp writes them
SILENCE_TIMEOUT_S = 120.0  # the exporter is bound first thing when the router starts
ASK_FOR_IT = "pass --router-prometheus-port PORT to serve the router's metrics on purpose"


def silence_metrics(port: int) -> None:
    """In the router's process, before the router starts and before any thread does: make the exporter the router
    will open on loopback `port` answer nobody (a helper process does it, then exits)."""
    router = os.getpid()
    if _fork_sharing_fds() != 0:
        return
    gc.disable()  # collect nothing: an object inherited from the router may own one of its descriptors
    try:
        done = _silence(port, router)
    except Exception as e:  # reported below, and the router is stopped
        print(f"vime: shutting vllm-router's Prometheus endpoint failed: {e!r}", file=sys.stderr, flush=True)
        done = False
    if not done and os.getppid() == router:
        print(f"vime: vllm-router's Prometheus endpoint on 127.0.0.1:{port} could not be closed to other users; "
              f"stopping the router ({ASK_FOR_IT})", file=sys.stderr, flush=True)
        os.kill(router, signal.SIGKILL)
    os._exit(0)


def _fork_sharing_fds() -> int:
    """fork(), but the child shares this process's file-descriptor table: 0 in the child, its pid here."""
    number = SYS_CLONE.get(platform.machine())
    if number is None:
        raise RuntimeError(f"vime cannot close vllm-router's Prometheus endpoint on {platform.machine()}; "
                           f"{ASK_FOR_IT}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    flags, null = ctypes.c_long(CLONE_FILES | signal.SIGCHLD), ctypes.c_long(0)  # full-width: syscall() is variadic
    pid = libc.syscall(ctypes.c_long(number), flags, null, null, null, null)  # no new stack: a copy, as fork()
    if pid < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"clone(CLONE_FILES) for closing vllm-router's Prometheus endpoint: "
                             f"{os.strerror(errno)}; {ASK_FOR_IT}")
    return pid


def _silence(port: int, router: int) -> bool:
    """Filter the exporter's listening socket once it appears, then shut the connections it took before: True when
    done, False when the router ended or the exporter never listened."""
    address = hex_address("127.0.0.1", port)
    deadline = time.monotonic() + SILENCE_TIMEOUT_S
    filtered = False
    while time.monotonic() < deadline and os.getppid() == router:
        fds = socket_fds()
        if not filtered:
            listening = [fds[inode] for local, _, state, _, inode in tcp_sockets()
                         if local == address and state == LISTEN and inode in fds]
            for fd in listening:
                drop_everything(fd)
            filtered = bool(listening)
        if filtered and shut_connections(address, fds) == 0:
            return True
        time.sleep(0.01)
    return False


def socket_fds() -> dict[int, int]:
    """{socket inode: descriptor} of this process's (here: the shared table's) sockets."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:["):
                found[int(target[8:-1])] = int(name)
    return found


def drop_everything(fd: int) -> None:
    """Attach the drop-everything filter to socket `fd`: a listener then answers no new connection attempt."""
    program = ctypes.create_string_buffer(DROP_EVERYTHING, len(DROP_EVERYTHING))
    with _borrowed(fd) as sock:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("@HP", 1, ctypes.addressof(program)))


def shut_connections(address: str, fds: dict[int, int]) -> int:
    """Shut the established connections to `address` (as /proc/net/tcp writes it) held in `fds`; returns how many
    are still open, counting those not yet accepted."""
    still_open = 0
    for local, _, state, _, inode in tcp_sockets():
        if local != address or state != ESTABLISHED:
            continue
        still_open += 1
        if inode in fds:
            with _borrowed(fds[inode]) as sock, contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the exporter sees the end and closes it
    return still_open


@contextlib.contextmanager
def _borrowed(fd: int):
    """A socket object over descriptor `fd` that leaves it open: the descriptor stays its owner's."""
    sock = socket.socket(fileno=fd)
    try:
        yield sock
    finally:
        sock.detach()
