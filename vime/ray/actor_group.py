"""The training actors: one Ray actor per Megatron rank, placed by a placement group, driven together.

    group = RayTrainGroup(args, pg)
    group.init(total_steps)
    metrics = group.train(rollout_id, groups)
"""

from __future__ import annotations

import ray

from vime.ray.placement import serving_host, use_gpu
from vime.utils.misc import find_free_port


class TrainActor:
    """Hosts one `MegatronTrainer`; its methods are what the driver calls over Ray."""

    def __init__(self, args, rank: int, world_size: int, role: str = "actor"):
        self.args, self.rank, self.world_size, self.role = args, rank, world_size, role
        self.trainer = None

    def address(self) -> tuple[str, int]:
        return serving_host(self.args), find_free_port()

    def init(self, master_addr: str, master_port: int, total_steps: int) -> None:
        from vime.backends.megatron_utils.trainer import MegatronTrainer

        self.trainer = MegatronTrainer(self.args, self.rank, self.world_size, master_addr, master_port, total_steps,
                                       role=self.role)

    def train(self, rollout_id: int, groups, values=None) -> dict:
        return self.trainer.train(rollout_id, groups, values)

    def call(self, method: str, *args, **kwargs):
        """Run any trainer method (save, load, weight export, probes) on this rank."""
        return getattr(self.trainer, method)(*args, **kwargs)


class RayTrainGroup:
    def __init__(self, args, placement=None, role: str = "actor", bundle_offset: int = 0):
        self.args = args
        self.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
        actor_cls = ray.remote(TrainActor)
        self.actors = []
        for rank in range(self.world_size):
            if placement is not None and placement.pg is not None:
                options = placement.actor_options(placement.actor_offset + bundle_offset + rank)
            else:
                options = {"num_cpus": 1, **({"num_gpus": 1} if use_gpu() else {})}
            self.actors.append(actor_cls.options(**options).remote(args, rank, self.world_size, role))

    def init(self, total_steps: int) -> None:
        master_addr, master_port = ray.get(self.actors[0].address.remote())
        ray.get([a.init.remote(master_addr, master_port, total_steps) for a in self.actors])

    def train(self, rollout_id: int, groups, values=None) -> dict[str, float]:
        """All ranks train together; the metrics come from the last pipeline stage."""
        ref = ray.put(groups)
        results = ray.get([a.train.remote(rollout_id, ref, values) for a in self.actors])
        return next((r for r in results if r), {})

    def call(self, method: str, *args, **kwargs) -> list:
        return ray.get([a.call.remote(method, *args, **kwargs) for a in self.actors])

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []
