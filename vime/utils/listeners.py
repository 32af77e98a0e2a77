"""Who holds a local TCP socket, read from /proc: the owner of the process at the other end of a loopback
connection (`peer_uid`: the router's front admits this user only), and whether a listening port is held by the
process tree vime started (`foreign_listener`: a secret goes to a server only once that is so).

Ports are chosen free and then bound by a child seconds later; meanwhile anyone on the node can bind the port and
answer /health. Checking the listening socket's owner before the first secret is sent closes that window.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"  # the TCP state /proc/net/tcp writes for a listening socket


def hex_address(host: str, port: int) -> str:
    """An address as /proc/net/tcp{,6} writes it: the IP's bytes as 32-bit host-order words in hex, then the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    raw = socket.inet_pton(family, host)
    words = [raw[i:i + 4] for i in range(0, len(raw), 4)]
    return "".join(int.from_bytes(w, "little").to_bytes(4, "big").hex().upper() for w in words) + f":{port:04X}"


def tcp_sockets() -> Iterator[tuple[str, str, str, int, int]]:
    """(local, remote, state, uid, inode) of every TCP socket of this network namespace."""
    for path in PROC_TCP:
        try:
            with open(path) as f:
                next(f)  # the header line
                for line in f:
                    fields = line.split()
                    yield fields[1], fields[2], fields[3], int(fields[7]), int(fields[9])
        except FileNotFoundError:
            continue


def peer_uid(peer: tuple, local: tuple) -> int | None:
    """The uid owning the socket at the other end of a loopback TCP connection from `peer` to `local` (host, port
    pairs as the connection reports them), or None when it is not found (a remote peer, or it closed)."""
    want_local, want_remote = hex_address(peer[0], peer[1]), hex_address(local[0], local[1])
    for local_hex, remote_hex, _, uid, _ in tcp_sockets():
        if local_hex == want_local and remote_hex == want_remote:
            return uid
    return None


def listeners(port: int) -> dict[int, int]:
    """{socket inode: owner uid} of the sockets listening on `port`, on any address."""
    suffix = f":{port:04X}"
    return {inode: uid for local, _, state, uid, inode in tcp_sockets() if state == _LISTEN and local.endswith(suffix)}


def process_tree(root: int) -> set[int]:
    """`root` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def socket_inodes(pids: set[int]) -> set[int]:
    """The inodes of the sockets open in processes `pids` (those this user may look into)."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def foreign_listener(port: int, root_pid: int) -> str | None:
    """None when every socket listening on `port` is held by this user's processes in the tree of `root_pid` (and
    there is one); else who holds it, for an error message."""
    held = listeners(port)
    if not held:
        return f"nothing listens on port {port}"
    ours, me = socket_inodes(process_tree(root_pid)), os.getuid()
    strangers = {inode: uid for inode, uid in held.items() if inode not in ours or uid != me}
    if not strangers:
        return None
    owners = sorted(set(strangers.values()))
    return (f"port {port} is held by a process that vime did not start (uid {', '.join(map(str, owners))}"
            f"{'' if owners != [os.getuid()] else ', this user'})")
