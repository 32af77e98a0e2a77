"""The driver's handle on the training ranks: one `TrainActor` (vime/trainer/actor.py) per Megatron rank, placed
by a placement group, driven together.

    group = RayTrainGroup(args, placement)
    ray.get(group.begin_init(total_steps))    # every rank builds its model
    metrics = group.train(rollout_id, handle)      # each rank reads the rollout from the data transport itself
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import ray

from vime.config.run import JobConfig, PlacementConfig
from vime.config.train import MegatronConfig, TrainLoopConfig
from vime.trainer.actor import TrainActor
from vime.utils.deadline import control, gather
from vime.utils.device import cluster_has_gpus
from vime.utils.misc import with_values


@dataclasses.dataclass(frozen=True)
class GroupCall:
    """How a `RayTrainGroup` verb runs `TrainActor.<verb>(...)`: on every rank or on rank 0 alone, under
    --train-timeout (work) or the control deadline (a read or a flip of state), the ranks' answers combined by
    `reduce`. `what` names the call in a deadline's or a failure's error, formatted with the call's arguments
    ({0}: the first)."""

    what: str
    ranks: str = "all"  # "all" | "first"
    deadline: str = "work"  # "work": --train-timeout | "control": CONTROL_TIMEOUT
    reduce: Callable[[list], Any] = list


def group_call(what: str, ranks: str = "all", deadline: str = "work", reduce: Callable[[list], Any] = list):
    """Declares a `RayTrainGroup` method that calls the `TrainActor` method of the same name on its ranks (see
    `GroupCall`). The declared method's signature and docstring are the verb's; its body is not run."""
    spec = GroupCall(what, ranks, deadline, reduce)

    def declare(stub):
        verb = stub.__name__

        @functools.wraps(stub)
        def call(self: RayTrainGroup, *args, **kwargs):
            actors = self.actors if spec.ranks == "all" else self.actors[:1]
            refs = [getattr(actor, verb).remote(*args, **kwargs) for actor in actors]
            what = f"the {self.role} ranks' {spec.what.format(*args, **kwargs)}"
            if spec.deadline == "control":
                return spec.reduce(control(refs, what))
            return spec.reduce(gather(refs, what, JobConfig.of(self.args).train_timeout, "--train-timeout"))

        call.group_call = spec
        return call

    return declare


def _first_nonempty(results: list[dict]) -> dict:
    """The ranks' answers -> the one that reports (the last pipeline stage's first rank), or {}."""
    return next((r for r in results if r), {})


def _first(results: list):
    return results[0]


class RayTrainGroup:
    """One `TrainActor` per rank of a role. Its verbs are declared with `@group_call` (which ranks, which deadline,
    how the answers combine); PPO's value hand-offs, which pass refs on, are written out."""

    def __init__(self, args, placement=None, role: str = "actor"):
        placement_flags = PlacementConfig.of(args)
        self.args = args
        self.role = role
        self.world_size = placement_flags.actor_num_nodes * placement_flags.actor_num_gpus_per_node
        actor_cls = ray.remote(TrainActor)
        self.actors = []
        for rank in range(self.world_size):
            share, local_rank = None, 0
            if placement is not None and placement.pg is not None:
                options = placement.actor_options(placement.bundle_of(role, rank))
                share, local_rank = placement.cpu_share(role, rank), placement.local_rank(role, rank)
            else:
                # the cluster's devices, not the driver's: a CPU-only head node places GPU ranks
                options = {"num_cpus": 1, **({"num_gpus": 1} if cluster_has_gpus() else {})}
            self.actors.append(actor_cls.options(**options).remote(args, rank, self.world_size, role, share,
                                                                   local_rank))

    def begin_init(self, total_steps: int) -> list[ray.ObjectRef]:
        """Start building every rank's model; the refs resolve when they are built."""
        master_addr, master_port = control(self.actors[0].address.remote(), f"{self.role} rank 0's address")
        return [a.init.remote(master_addr, master_port, total_steps) for a in self.actors]

    # every rank trains together; the metrics come from the last pipeline stage's first rank
    @group_call("training on rollout {0}", reduce=_first_nonempty)
    def train(self, rollout_id: int, handle) -> dict:
        """Every rank trains on the rollout behind `handle`."""

    @group_call("offload (--offload-train)")
    def offload(self) -> list[int]:
        """Every rank's state to host memory; the bytes each moved."""

    @group_call("onload (--offload-train)")
    def onload(self) -> list[int]:
        """Every rank's state back on its device."""

    @group_call("checkpoint save of rollout {0}")
    def save(self, rollout_id: int, extra_state: dict | None = None) -> list[str]:
        """Every rank saves its part of iteration `rollout_id`."""

    @group_call("HF save into {0}")
    def save_hf(self, out_dir: str) -> list[str]:
        """The policy as an HF checkpoint (collective)."""

    # files only, on the trainers' node (which sees --save)
    @group_call("publishing the checkpoint of rollout {0}", ranks="first", reduce=_first)
    def publish_checkpoint(self, rollout_id: int, parts: list[str]) -> str:
        """Make iteration `rollout_id` the one a resume starts from."""

    @group_call("loaded state", deadline="control")
    def get_loaded_state(self) -> list[dict | None]:
        """What each rank loaded from --load (None: nothing)."""

    # the run-time values every rank's custom functions see in `args` (vime.utils.plugin_args)
    @group_call("plugin values", deadline="control", reduce=lambda _: None)
    def set_plugin_values(self, values: dict) -> None:
        """Every rank's custom functions see `values` in their `args`."""

    @group_call("the weight check's probe forward")
    def probe_log_probs(self, tokens: list[int], response_length: int, temperature: float | None = None,
                        adapter: str | None = None) -> list[list[float]]:
        """Each rank's log-probs of the probe's response ([] off the last pipeline stage)."""

    @group_call("dtype and device", ranks="first", reduce=lambda results: tuple(results[0]))
    def compute_kind(self) -> tuple[str, str]:
        """(dtype, device type) the ranks compute in, as rank 0 reports it."""

    # PPO. Values and returns pass between the groups as object refs: the driver never fetches them.
    def compute_values(self, handle) -> list[ray.ObjectRef]:
        """The critic's values, one ref per rank (each holds its own samples' values)."""
        return [a.compute_values.remote(handle) for a in self.actors]

    def train_with_values(self, rollout_id: int, handle, values: list[ray.ObjectRef]) -> tuple[dict, ray.ObjectRef]:
        """The actor's step with the critic's values; returns (metrics, a ref to the GAE returns)."""
        refs = [a.train_with_values.options(num_returns=2).remote(rollout_id, handle, *values) for a in self.actors]
        return _first_nonempty(self._all([m for m, _ in refs], f"training on rollout {rollout_id}")), refs[0][1]

    def train_critic(self, rollout_id: int, handle, values: list[ray.ObjectRef], returns: ray.ObjectRef) -> dict:
        return _first_nonempty(self._all([a.train_critic.remote(rollout_id, handle, returns, *values)
                                          for a in self.actors], f"training on rollout {rollout_id}"))

    def _all(self, refs, what: str):
        """Every rank's answer to one call, at most --train-timeout; a rank that fails fails it at once."""
        job = JobConfig.of(self.args)
        return gather(refs, f"the {self.role} ranks' {what}", job.train_timeout, "--train-timeout")

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []


def critic_args(args):
    """The critic trains with its own learning rate; its checkpoints are the critic part of the actor's
    (`checkpoint_files.part_dir`)."""
    train_loop = TrainLoopConfig.of(args)
    megatron = MegatronConfig.of(args)
    lr = train_loop.critic_lr if train_loop.critic_lr is not None else megatron.lr
    return with_values(args, lr=lr, use_kl_loss=False, kl_coef=0.0)
