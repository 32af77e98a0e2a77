"""A training rank's half of the broadcast transport: the writer of each pipeline stage joins the weight group and
broadcasts its tensors (`vime.engine.protocol.weight_broadcast`)."""

from __future__ import annotations

from vime.engine.protocol.weight_broadcast import broadcast_weights, group_backend, join_group
from vime.transport.weights.base import Weights, WeightSender


class BroadcastSender(WeightSender):
    def __init__(self) -> None:
        self.group: dict = {}  # the group this writer joined, {"key", "pg"}

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

    def close(self) -> None:
        """Leave the group (tests, benchmarks; a run's processes just exit)."""
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        if self.group.get("pg") is not None:
            stateless_destroy_torch_distributed_process_group(self.group["pg"])
        self.group.clear()
