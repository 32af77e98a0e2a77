"""The training group's rendezvous store listens on the address it was given alone, never on every interface as
torch's own TCPStore does ([::] / 0.0.0.0, answering anyone who reaches the node), and its port is held from the
moment the trainer hands out its address (`vime.utils.rendezvous`). Listening sockets are read from
/proc/net/tcp{,6}; the weight-broadcast group's store is checked in test_weight_transport.py."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest

from vime.utils.listeners import hex_address, socket_inodes, tcp_sockets

pytest.importorskip("megatron.core")

LISTEN = "0A"


def listening_addresses(port: int) -> set[str]:
    """The local addresses (as /proc/net/tcp writes them) of every socket listening on `port`."""
    return {local for local, _, state, _, _ in tcp_sockets() if state == LISTEN and local.endswith(f":{port:04X}")}


WILDCARDS = ("00000000", "0" * 32)  # 0.0.0.0 and [::] as /proc/net/tcp{,6} write them


def own_wildcard_listeners() -> set[str]:
    """The local addresses of the sockets this process listens on every interface with."""
    ours = socket_inodes({os.getpid()})
    return {local for local, _, state, _, inode in tcp_sockets()
            if state == LISTEN and inode in ours and local.rsplit(":", 1)[0] in WILDCARDS}


def _trainer_address() -> tuple[str, int]:
    """What training rank 0 answers when the driver asks where its groups meet (one node: no --ray-address)."""
    from vime.arguments import build_parser
    from vime.driver.train_group import TrainActor

    flags = build_parser().parse_args(["--hf-checkpoint", "x"])
    return TrainActor.address(SimpleNamespace(args=flags))


@pytest.fixture
def torchrun_env(monkeypatch):
    """Sets torchrun's variables for a one-rank group meeting at (host, port)."""
    def set_env(host: str, port: int) -> None:
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": host,
                            "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
    return set_env


def test_the_trainers_address_is_held_from_the_moment_it_is_given():
    host, port = _trainer_address()
    assert host == "127.0.0.1"
    assert listening_addresses(port) == {hex_address("127.0.0.1", port)}  # bound and listening: nobody can take it
    for address in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as other, pytest.raises(OSError):
            other.bind((address, port))
    from vime.utils.rendezvous import take_reserved

    take_reserved(host, port).close()


def test_a_training_groups_store_listens_on_master_addr_alone(torchrun_env):
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel
    from vime.utils.misc import find_free_port

    port = find_free_port()
    torchrun_env("127.0.0.1", port)
    init_parallel(1, 1, seed=1234)
    try:
        assert listening_addresses(port) == {hex_address("127.0.0.1", port)}  # not [::] nor 0.0.0.0
    finally:
        destroy_parallel()


def test_the_store_serves_on_the_socket_reserved_with_the_address(torchrun_env):
    """The trainer's flow: rank 0 gives out its address, then builds the group there on the socket it kept."""
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel
    from vime.utils import rendezvous

    host, port = _trainer_address()
    (reserved_inode,) = {inode for local, _, state, _, inode in tcp_sockets()
                         if state == LISTEN and local == hex_address(host, port)}
    torchrun_env(host, port)
    init_parallel(1, 1, seed=1234)
    try:
        assert (host, port) not in rendezvous._reserved  # the store took it
        assert {inode for local, _, state, _, inode in tcp_sockets()
                if state == LISTEN and local.endswith(f":{port:04X}")} == {reserved_inode}
    finally:
        destroy_parallel()


def test_a_one_process_group_has_no_store_on_every_interface(monkeypatch):
    """Its store is in memory: no socket at all (gloo's own listeners follow the host name, as before)."""
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert own_wildcard_listeners() == set()
    init_parallel(1, 1, seed=1234)
    try:
        assert own_wildcard_listeners() == set()
    finally:
        destroy_parallel()


def test_a_taken_port_fails_naming_its_holder(torchrun_env):
    from vime.trainer.megatron.parallel import init_parallel
    from vime.utils.misc import find_free_port

    with socket.socket() as other:
        other.bind(("0.0.0.0", find_free_port()))
        other.listen()
        port = other.getsockname()[1]
        torchrun_env("127.0.0.1", port)
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} .*held by uid {os.getuid()}.*"
                                          "MASTER_PORT"):
            init_parallel(1, 1, seed=1234)


def test_a_half_set_torchrun_environment_says_what_is_missing(torchrun_env, monkeypatch):
    from vime.trainer.megatron.parallel import init_parallel

    torchrun_env("127.0.0.1", 1)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="WORLD_SIZE is set but MASTER_PORT is not"):
        init_parallel(1, 1, seed=1234)
