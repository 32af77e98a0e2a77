"""The driver's half of the broadcast transport: one group key and rendezvous address per engine set, each
engine's receive call."""

from __future__ import annotations

import uuid
from typing import Callable

from vime.transport.weights.base import DriverSetup, TransportDriver


def engine_set_key(state: dict, engine_urls: list[str], trainer_address: Callable[[], tuple[str, int]] | None = None):
    """(key, rendezvous address) for the current engine set; a new key (and address) when the set changes.

    Called in the driver, `state` kept by its transport for the run. Trainer writers and engine workers keep the
    group they built under a key and rebuild it when the handle carries another one, so the key is the only
    thing that decides reuse."""
    engines = tuple(engine_urls)
    if engines != state.get("engines"):
        state.update(engines=engines, key=uuid.uuid4().hex, address=None)
    if state.get("address") is None and trainer_address is not None:
        state["address"] = trainer_address()
    return state["key"], state["address"]


class BroadcastDriver(TransportDriver):
    concurrent = True  # send and apply join the same collective: the driver starts both, then waits for both

    def __init__(self, setup: DriverSetup = DriverSetup()):
        self.bucket_bytes = int(setup.weight_sync.update_weight_buffer_size)
        self.num_senders = int(setup.megatron.pipeline_model_parallel_size)
        self.workers_per_engine = int(setup.engines.rollout_num_gpus_per_engine)
        self.engine_set: dict = {}  # the engine set, its group key and rendezvous address
        self.engine_urls: list[str] | None = None

    def connect(self, engine_urls: list[str], trainer_address: Callable[[], tuple[str, int]]) -> None:
        """Before `prepare`: the engines, and a (host, free port) on training rank 0's node."""
        self.engine_urls = list(engine_urls)
        engine_set_key(self.engine_set, engine_urls, trainer_address)

    def prepare(self, version: int) -> dict:
        if self.engine_urls is None:
            raise RuntimeError("BroadcastDriver.connect(engine_urls, trainer_address) must run first")
        # no backend here: each member picks it for the device it holds its tensors on (`group_backend`); the
        # driver may run on a CPU-only head node
        host, port = self.engine_set["address"]
        return {"version": version, "key": self.engine_set["key"], "master_addr": host, "master_port": port,
                "engine_urls": self.engine_urls, "num_senders": self.num_senders,
                "world_size": self.num_senders + len(self.engine_urls) * self.workers_per_engine,
                "bucket_bytes": self.bucket_bytes}

    def bound_engines(self, handle: dict) -> list[str]:
        return handle["engine_urls"]

    def load_calls(self, engine_urls: list[str], handle: dict) -> dict:
        """Each engine's receive (the caller runs them at once: each blocks until the whole group has joined)."""
        if list(engine_urls) != handle["engine_urls"]:
            raise RuntimeError(f"engine set changed between prepare and apply: {handle['engine_urls']} -> "
                               f"{engine_urls}")
        common = {"key": handle["key"], "master_addr": handle["master_addr"],
                  "master_port": str(handle["master_port"]), "world_size": str(handle["world_size"]),
                  "num_senders": str(handle["num_senders"]), "bucket_bytes": str(handle["bucket_bytes"])}
        return {url: ("vime_receive_weights",
                      {**common, "rank_offset": str(handle["num_senders"] + index * self.workers_per_engine)})
                for index, url in enumerate(engine_urls)}

    def cleanup(self, handle: dict) -> None:
        pass  # the group stays up for the next update
