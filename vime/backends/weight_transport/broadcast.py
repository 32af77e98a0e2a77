"""Weight sync in memory: the training writers broadcast HF tensors over a process group the engines joined.

    python train.py --update-weight-transport broadcast [--update-weight-buffer-size BYTES] ...

Group: rank s = the writer of pipeline stage s (DP rank 0, TP rank 0), then every engine worker
(`len(stages) + engine_index * workers_per_engine + worker_rank`). It is built with vLLM's
`stateless_init_torch_distributed_process_group` (gloo on CPU, nccl on GPU) on the first update, kept by every
member, and rebuilt when the engine set changes (the driver hands out a new group key).

Wire protocol, once per writer (in stage order; every member takes part in every broadcast): a JSON list of
[name, dtype, shape] (its length, then its bytes), then the tensors, in order, as flat uint8 broadcasts: small
ones packed into buckets of at most --update-weight-buffer-size bytes, each tensor of 1 MiB or more on its own
(sent from its own memory, no copy). Both sides cut buckets with `plan_buckets`, so no per-bucket header
travels. The engine side (`vime.backends.weight_transport.worker_extension`) feeds the tensors, as they arrive, to
vLLM's `reload_weights(weights_iterator=...)`: on CPU the linear weights are repacked after loading, so writing
into the parameters would not update anything.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Callable, Iterator

import torch

from vime.backends.weight_transport.base import Weights, WeightTransport

ALIGN = 64  # byte alignment of every tensor inside a bucket, so each can be viewed as its own dtype
ALONE_BYTES = 1 << 20  # tensors this large travel on their own: packing gains nothing but a copy
GROUP_TIMEOUT_S = 600  # a member that never shows up fails the update after this long instead of hanging

# ---- driver side: one group key per engine set ------------------------------------------------------------------
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


# ---- wire protocol (both sides) -------------------------------------------------------------------------------
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def plan_buckets(meta: list, bucket_bytes: int) -> list[tuple[list[tuple[str, torch.dtype, list[int], int]], int]]:
    """Cut [name, dtype, shape] entries, in order, into buckets: [([(name, dtype, shape, byte offset)], bytes)].

    Small tensors are packed up to `bucket_bytes`; a tensor of ALONE_BYTES or more (or of `bucket_bytes` or more)
    is a bucket of its own, which the sender broadcasts from the tensor's memory: packing it would only copy it
    (on CPU that copy into fresh pages cost as much as the transfer)."""
    buckets, current, size = [], [], 0
    for name, dtype_name, shape in meta:
        dtype = _dtype(dtype_name)
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        alone = nbytes >= min(ALONE_BYTES, bucket_bytes)
        offset = -(-size // ALIGN) * ALIGN
        if current and (alone or offset + nbytes > bucket_bytes):
            buckets.append((current, size))
            current, offset = [], 0
        current.append((name, dtype, list(shape), offset))
        size = offset + nbytes
        if alone:
            buckets.append((current, size))
            current, size = [], 0
    if current:
        buckets.append((current, size))
    return buckets


def _broadcast_json(pg, obj, src: int, device) -> object:
    if pg.rank() == src:
        payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    pg.broadcast(length, src).wait()
    if pg.rank() != src:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    pg.broadcast(payload, src).wait()
    return json.loads(payload.cpu().numpy().tobytes())


def broadcast_weights(pg, num_senders: int, bucket_bytes: int, device,
                      own: list[tuple[str, torch.Tensor]] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Run the protocol as any member; yields the (name, tensor) pairs sent by the *other* members.

    `own`: this member's tensors when it is a sender (group rank < num_senders). Received tensors are views
    into a fresh bucket buffer each (vLLM's layer-wise reload holds on to them until a layer is complete)."""
    for src in range(num_senders):
        sending = pg.rank() == src
        meta = _broadcast_json(pg, [[n, str(t.dtype), list(t.shape)] for n, t in own] if sending else None,
                               src, device)
        by_name = dict(own) if sending else {}
        for entries, total in plan_buckets(meta, bucket_bytes):
            if sending and len(entries) == 1:  # a tensor alone travels from its own memory
                flat = by_name[entries[0][0]].contiguous().view(-1).view(torch.uint8)
            elif sending:
                flat = torch.empty(total, dtype=torch.uint8, device=device)
                for name, dtype, shape, offset in entries:
                    t = by_name[name]
                    flat[offset:offset + t.numel() * t.element_size()].copy_(t.contiguous().view(-1).view(torch.uint8))
            else:
                flat = torch.empty(total, dtype=torch.uint8, device=device)
            pg.broadcast(flat, src).wait()
            if sending:
                continue
            for name, dtype, shape, offset in entries:
                nbytes = dtype.itemsize * int(torch.Size(shape).numel())
                yield name, flat[offset:offset + nbytes].view(dtype).view(shape)


def join_group(cache: dict, key: str, master_addr: str, master_port: int, rank: int, world_size: int,
               backend: str):
    """The process group for `key`: reused from `cache` (a dict this member keeps), or (re)built."""
    from vllm.distributed.utils import (stateless_destroy_torch_distributed_process_group,
                                        stateless_init_torch_distributed_process_group)

    if cache.get("key") == key:
        return cache["pg"]
    if cache.get("pg") is not None:
        stateless_destroy_torch_distributed_process_group(cache["pg"])
        cache.clear()
    pg = stateless_init_torch_distributed_process_group(master_addr, master_port, rank, world_size, backend,
                                                        timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    cache.update(key=key, pg=pg)
    return pg


def group_backend(device) -> str:
    """The weight group's backend for a member holding its tensors on `device`: NCCL for GPU tensors, gloo for
    CPU ones. Every member decides for itself, where it runs (training writers and engines are on the same kind
    of device)."""
    return "nccl" if str(device).partition(":")[0] == "cuda" else "gloo"


# ---- the transport --------------------------------------------------------------------------------------------
class BroadcastWeightTransport(WeightTransport):
    concurrent = True  # send and apply join the same collective: the driver starts both, then waits for both

    def __init__(self, args):
        super().__init__(args)
        self.bucket_bytes = int(args.update_weight_buffer_size)
        self.num_senders = int(args.pipeline_model_parallel_size)
        self.workers_per_engine = int(args.rollout_num_gpus_per_engine)
        self.engine_set: dict = {}  # driver: the engine set, its group key and rendezvous address
        self.engine_urls: list[str] | None = None
        self.group: dict = {}  # a training writer: the group it joined, {"key", "pg"}

    def connect(self, engine_urls: list[str], trainer_address: Callable[[], tuple[str, int]]) -> None:
        """Driver side, before `prepare`: the engines, and a (host, free port) on training rank 0's node."""
        self.engine_urls = list(engine_urls)
        engine_set_key(self.engine_set, engine_urls, trainer_address)

    def prepare(self, version: int) -> dict:
        if self.engine_urls is None:
            raise RuntimeError("BroadcastWeightTransport.connect(engine_urls, trainer_address) must run first")
        # no backend here: each member picks it for the device it holds its tensors on (`group_backend`); the
        # driver may run on a CPU-only head node
        host, port = self.engine_set["address"]
        return {"version": version, "key": self.engine_set["key"], "master_addr": host, "master_port": port,
                "engine_urls": self.engine_urls, "num_senders": self.num_senders,
                "world_size": self.num_senders + len(self.engine_urls) * self.workers_per_engine,
                "bucket_bytes": self.bucket_bytes}

    def send(self, weights: Weights, stage: int | None, handle: dict) -> None:
        """The writer of each pipeline stage broadcasts its tensors to the group."""
        if stage is None:
            return
        from vime.utils.device import local_device

        device = local_device()  # the training writer's own
        weights = [(name, t.detach().to(device)) for name, t in weights]
        pg = join_group(self.group, handle["key"], handle["master_addr"], handle["master_port"], stage,
                        handle["world_size"], group_backend(device))
        for _ in broadcast_weights(pg, handle["num_senders"], handle["bucket_bytes"], device, own=weights):
            pass  # another stage's tensors: this writer only relays its part of the collective

    def bound_engines(self, handle: dict) -> list[str]:
        return handle["engine_urls"]

    def close(self) -> None:
        """A training writer leaves its group (tests, benchmarks; a run's processes just exit)."""
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        if self.group.get("pg") is not None:
            stateless_destroy_torch_distributed_process_group(self.group["pg"])
        self.group.clear()

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
