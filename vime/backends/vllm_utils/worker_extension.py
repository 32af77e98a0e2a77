"""Methods vime adds to every vLLM worker (`--worker-extension-cls ...worker_extension.WeightReceiver`).

vLLM mixes this class into its worker class, so `self` is the worker (`self.reload_weights`, `self.rank`,
`self.device`). Called through the dev-mode `/collective_rpc` route, which passes only string arguments.
`engine_command` adds the flag by itself when --update-weight-transport is broadcast.
"""

from __future__ import annotations

import torch


class WeightReceiver:
    def vime_receive_weights(self, key: str, master_addr: str, master_port: str, rank_offset: str, world_size: str,
                             num_senders: str, bucket_bytes: str, backend: str) -> dict:
        """Join (or reuse) the weight group `key` and reload the weights the training writers broadcast.

        Blocks until every member has joined and every writer has sent; see
        `vime.backends.weight_transport.broadcast` for the protocol. Returns {"tensors", "bytes"} received."""
        from vime.backends.weight_transport.broadcast import broadcast_weights, join_group

        cache = self.__dict__.setdefault("_vime_weight_group", {})
        pg = join_group(cache, key, master_addr, int(master_port), int(rank_offset) + self.rank, int(world_size),
                        backend)
        device = getattr(self, "device", None) or torch.device("cpu")
        received = broadcast_weights(pg, int(num_senders), int(bucket_bytes), device)
        stats = {"tensors": 0, "bytes": 0}

        def counted():
            for name, tensor in received:
                stats["tensors"] += 1
                stats["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor

        tensors = counted()
        self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
        for _ in tensors:  # a loader that stopped early must not leave the group's broadcasts half done
            pass
        return stats

    def vime_load_ipc_weights(self, path: str) -> dict:
        """Colocated GPUs: reload from the trainer's CUDA IPC handles in `path` (see weight_transport.cuda_ipc)."""
        from vime.backends.weight_transport.cuda_ipc import open_ipc_tensors

        count = 0

        def tensors():
            nonlocal count
            for name, tensor in open_ipc_tensors(path, self.device.index):
                count += 1
                yield name, tensor

        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        return {"tensors": count}
