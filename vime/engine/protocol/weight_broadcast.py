"""The in-memory weight broadcast, as every member of the weight group runs it: each training writer (one per
pipeline stage) sends, every engine worker (`vime.engine.in_vllm.worker_extension`) receives.

Group: rank s = the writer of pipeline stage s (DP rank 0, TP rank 0), then every engine worker
(`len(stages) + engine_index * workers_per_engine + worker_rank`). It is built with vLLM's
`stateless_init_torch_distributed_process_group` (gloo on CPU, nccl on GPU) on the first update, kept by every
member, and rebuilt when the engine set changes (the driver hands out a new group key). Its store is served by
rank 0 on the master address alone (`vime.utils.rendezvous`), not on every interface.

Wire protocol, once per writer (in stage order; every member takes part in every broadcast): a JSON list of
[name, dtype, shape] (its length, then its bytes), then the tensors, in order, as flat uint8 broadcasts: small
ones packed into buckets of at most --update-weight-buffer-size bytes, each tensor of 1 MiB or more on its own
(sent from its own memory, no copy). Both sides cut buckets with `plan_buckets`, so no per-bucket header
travels.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Iterator

import torch

ALIGN = 64  # byte alignment of every tensor inside a bucket, so each can be viewed as its own dtype
ALONE_BYTES = 1 << 20  # tensors this large travel on their own: packing gains nothing but a copy
GROUP_TIMEOUT_S = 600  # a member that never shows up fails the update after this long instead of hanging


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

    from vime.utils.rendezvous import take_reserved

    if cache.get("key") == key:
        return cache["pg"]
    if cache.get("pg") is not None:
        stateless_destroy_torch_distributed_process_group(cache["pg"])
        cache.clear()
    # rank 0 serves the group's store on the socket it reserved for master_addr (`reserve_rendezvous`): torch's own
    # would listen on every interface, to anyone
    listen_socket = take_reserved(master_addr, master_port) if rank == 0 else None
    pg = stateless_init_torch_distributed_process_group(master_addr, master_port, rank, world_size, backend,
                                                        listen_socket=listen_socket,
                                                        timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    cache.update(key=key, pg=pg)
    return pg


def group_backend(device) -> str:
    """The weight group's backend for a member holding its tensors on `device`: NCCL for GPU tensors, gloo for
    CPU ones. Every member decides for itself, where it runs (training writers and engines are on the same kind
    of device)."""
    return "nccl" if str(device).partition(":")[0] == "cuda" else "gloo"
