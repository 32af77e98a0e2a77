"""torch.distributed rendezvous stores that listen only where vime says, on a port held from the moment it is chosen.

torch's TCPStore, as the master, listens on every interface ([::] and 0.0.0.0) whatever host it is given, and
answers anyone who reaches it, with no credential, for as long as its group lives: whoever can reach the node could
delete or overwrite keys and break or hijack the training group or the weight-broadcast group. vime's master stores
listen instead on a socket vime bound itself (TCPStore's `master_listen_fd`): on the address the group was given
(loopback on one node, the node's serving address on a cluster: `vime.utils.device.serving_host`).

The rank that will be the master chooses the port with `reserve_rendezvous`, which binds it at once and keeps the
socket until `master_store` (or `take_reserved`) hands it to the store: nobody can take the port between the
moment its address is given out and the moment the store serves on it.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from vime.utils.listeners import listeners
from vime.utils.misc import find_free_port

BIND_ATTEMPTS = 8  # a free port can be taken before we bind it; then another is chosen
_reserved: dict[tuple[str, int], socket.socket] = {}  # (host, port) -> its listening socket, until a store takes it


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on `host`:`port` alone (not on every interface); an error naming the holder when the port
    is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store: a recent group's TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        holders = sorted(set(listeners(port).values()))
        held = f"; it is held by uid {', '.join(map(str, holders))}" if holders else ""
        raise OSError(e.errno, f"torch.distributed's rendezvous cannot listen on {host}:{port} ({e.strerror}{held}). "
                               "Give the group another port (MASTER_PORT), or start the run again: vime then "
                               "chooses a fresh one") from e
    return sock


def reserve_rendezvous(host: str) -> tuple[str, int]:
    """(host, port) for a group whose master store runs in this process: a free port on `host`, bound and listening
    now, kept for `master_store` / `take_reserved`."""
    for attempt in range(1, BIND_ATTEMPTS + 1):
        port = find_free_port(host)
        try:
            _reserved[(host, port)] = listening_socket(host, port)
            return host, port
        except OSError:  # taken since it was found free
            if attempt == BIND_ATTEMPTS:
                raise


def take_reserved(host: str, port: int) -> socket.socket:
    """The socket `reserve_rendezvous` bound for (host, port), else one bound now: it is the caller's."""
    return _reserved.pop((host, port), None) or listening_socket(host, port)


def master_store(host: str, port: int, world_size: int, timeout: timedelta):
    """The master's TCPStore of a group, serving on (host, port) only."""
    from torch.distributed import TCPStore

    listen_fd = take_reserved(host, port).detach()  # the store owns the descriptor from here on
    try:
        return TCPStore(host, port, world_size, True, timeout, master_listen_fd=listen_fd)
    except BaseException:
        socket.close(listen_fd)
        raise
