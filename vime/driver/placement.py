"""Ray start-up, the placement group of training ranks and engines, and the CPUs each of them computes on.

On GPU clusters a bundle is one GPU; on CPU machines the same code uses CPU bundles, one per engine slot.
Ray's CPU counts are logical here: each compute process is given its share of its node's CPUs
(`Placement.cpu_share`) and sizes its own thread pools from it.

Devices: bundles are used in the order of (node, GPU id), so a tensor-parallel engine's consecutive bundles are
GPUs of one node. A training rank asks Ray for a share of its own bundle, so Ray shows it that bundle's GPU alone;
an engine's actor sits on its first bundle and starts its vLLM server with all of its bundles' GPUs visible
(`engine_gpus`: vLLM's workers then take one each).
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from vime.config.agents import JudgeConfig
from vime.config.rollout import EnginesConfig
from vime.config.run import JobConfig, PlacementConfig
from vime.driver.ray_auth import drop_run_token, use_run_token, warn_if_unauthenticated
from vime.utils.cpus import CpuShare
from vime.utils.device import cluster_has_gpus


WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def init_ray(job: JobConfig, placement: PlacementConfig, engines: EnginesConfig, judge: JudgeConfig) -> None:
    """Join --ray-address's cluster (`job`), else start the run's own on this machine, with logical CPUs enough for
    the ranks `placement`, `engines` and `judge` ask for."""
    if ray.is_initialized():
        return
    if job.ray_address:
        ray.init(address=job.ray_address, runtime_env={"env_vars": WORKER_ENV}, log_to_driver=True)
        warn_if_unauthenticated(job.ray_address)
        return
    # A local cluster's workers inherit this process's environment. A runtime_env would cost every actor a round
    # trip to Ray's runtime-env agent before its process starts (~1 s each, measured), on the engines' start-up
    # path too.
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    # A local cluster stays on loopback: engines and their control routes are never exposed to a network. It is
    # the run's own (address "local"), never another Ray instance found on this machine.
    judges = judge.judge_num_engines if judge.judge_checkpoint else 0
    slots = engines.rollout_num_gpus + placement.actor_num_nodes * placement.actor_num_gpus_per_node + judges + 2
    # Ray runs its workers at nice 15 by default; ours are the processes that compute. Nor does it prestart idle
    # workers: a process each, started while the run starts and competing with it for the CPUs, that no actor of
    # the run would use (each actor starts its own).
    use_run_token()  # the cluster asks for a token only this run has (vime.driver.ray_auth)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, slots), include_dashboard=False, log_to_driver=True,
             _node_ip_address="127.0.0.1", _system_config={"worker_niceness": 0, "enable_worker_prestart": False})


def shutdown_ray() -> None:
    """Stop Ray (the run's local cluster with it) and drop the run's Ray token."""
    ray.shutdown()
    drop_run_token()


class Placement:
    """Where each actor goes: one placement group, one bundle per device (GPU) or device slot (CPU).

    Disaggregated: training ranks take bundles [0, world), engines the next --rollout-num-gpus bundles.
    Colocated (--colocate): both start at bundle 0 and share them, each actor asking for a fraction so that a
    trainer and an engine fit in one bundle and take turns.

    CPUs: `overlap` says whether training and generation run at the same time (train_async.py). If not, the
    phase that runs gets all of a node's CPUs: its training ranks split them, and so do its engines. If so,
    each node's CPUs are split between all of them (an engine counting one share per worker).

    `use_critic` (PPO, `AlgorithmConfig.use_critic`): the trainers include a critic's ranks.
    """

    def __init__(self, placement: PlacementConfig, engines: EnginesConfig, judge: JudgeConfig, *, use_critic: bool,
                 with_engines: bool = True, with_trainers: bool = True, overlap: bool = False):
        actors = placement.actor_num_nodes * placement.actor_num_gpus_per_node if with_trainers else 0
        critic = with_trainers and use_critic  # PPO: as many critic ranks as actor ranks
        trainers = actors * (2 if critic else 1)
        engine_slots = 0 if (not with_engines or engines.rollout_external_engine_addrs) else engines.rollout_num_gpus
        # --judge-checkpoint: the judge's engines, one device each, of their own (never shared with the training)
        judges = judge.judge_num_engines if with_engines and judge.judge_checkpoint else 0
        self.colocate = bool(placement.colocate and actors and engine_slots)
        self.actor_offset = 0
        if self.colocate:  # actor, engine (and critic) share each bundle and take turns
            self.critic_offset = self.rollout_offset = 0
            n_bundles = max(actors, engine_slots)
            self.share = 1 / 3 if critic else 0.5
        else:
            self.critic_offset, self.rollout_offset = actors, trainers
            n_bundles = trainers + engine_slots
            self.share = 1.0
        self.judge_offset, n_bundles = n_bundles, n_bundles + judges
        self.gpus = cluster_has_gpus()
        bundle = {"GPU": 1, "CPU": 1} if self.gpus else {"CPU": 1}
        self.gpus_per_engine = engines.rollout_num_gpus_per_engine
        self.pg = None
        self.cpu_shares: dict[tuple[str, int], CpuShare] = {}
        self.bundle_nodes: list[str] = []  # bundle index -> node id
        self.bundle_gpus: list[str | None] = []  # bundle index -> the GPU id Ray gave it (None on CPU)
        self.slots: list[int] = []  # the bundles in (node, GPU id) order: slot i is bundle slots[i]
        self.ranks = {"actor": actors if with_trainers else 0, "critic": actors if critic else 0,
                      "engine": engine_slots // self.gpus_per_engine, "judge": judges}
        if n_bundles:
            self.pg = placement_group([dict(bundle) for _ in range(n_bundles)], strategy="PACK")
            ray.get(self.pg.ready(), timeout=600)
            table = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
            self.bundle_nodes = [table[b] for b in range(n_bundles)]
            self.bundle_gpus = bundle_gpu_ids(self.pg, n_bundles) if self.gpus else [None] * n_bundles
            self.slots = device_order(self.bundle_nodes, self.bundle_gpus)
            try:
                for rank in range(self.ranks["engine"]):
                    self.engine_gpus(rank)  # an engine whose GPUs span nodes cannot start: say so now
            except ValueError:
                self.release()
                raise
            self.cpu_shares = self._split_cpus(self.ranks, self.gpus_per_engine, overlap)

    def release(self) -> None:
        """Give the cluster back the devices this run reserved (a cluster that outlives the run: --ray-address, or
        a process that runs several)."""
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None

    def engine_bundles(self, rank: int) -> list[int]:
        """Every bundle of engine `rank` (one per tensor-parallel worker)."""
        first = self.rollout_offset + rank * self.gpus_per_engine
        return [self.slots[slot] for slot in range(first, first + self.gpus_per_engine)]

    def engine_gpus(self, rank: int) -> list[str] | None:
        """The GPU ids (as its node numbers them) that engine `rank`'s server sees, one per worker; None on CPU."""
        if not self.gpus:
            return None
        bundles = self.engine_bundles(rank)
        if len({self.bundle_nodes[b] for b in bundles}) > 1:
            raise ValueError(f"engine {rank}'s {len(bundles)} GPUs (--rollout-num-gpus-per-engine) are on different "
                             "nodes; one vLLM server runs on one node: give every node a multiple of "
                             "--rollout-num-gpus-per-engine GPUs, or use fewer GPUs per engine")
        return [self.bundle_gpus[b] for b in bundles]

    def judge_gpus(self, rank: int) -> list[str] | None:
        """The GPU id the judge's engine `rank` serves on; None on CPU."""
        return [self.bundle_gpus[self.bundle_of("judge", rank)]] if self.gpus else None

    def bundle_of(self, role: str, rank: int) -> int:
        """The (first) bundle of `role` ("actor", "critic", "engine" or "judge") rank `rank`."""
        if role == "engine":
            return self.engine_bundles(rank)[0]
        offset = {"critic": self.critic_offset, "judge": self.judge_offset}.get(role, self.actor_offset)
        return self.slots[offset + rank]

    def local_rank(self, role: str, rank: int) -> int:
        """`rank`'s index among the ranks of its role on its node (torchrun's LOCAL_RANK)."""
        node = self.bundle_nodes[self.bundle_of(role, rank)]
        return sum(self.bundle_nodes[self.bundle_of(role, r)] == node for r in range(rank))

    def cpu_share(self, role: str, rank: int) -> CpuShare:
        """The share of its node's CPUs that `role` rank `rank` computes on (all of them without a placement)."""
        return self.cpu_shares.get((role, rank), CpuShare())

    def _split_cpus(self, ranks: dict[str, int], gpus_per_engine: int, overlap: bool) -> dict:
        """Per (role, rank), its CpuShare. Processes that compute at the same time on a node split it: without
        overlap each role's ranks split the whole node; with it the node is cut between the training side and the
        engines, in proportion to their units (one per training rank, one per engine worker), then within each."""
        nodes = self.bundle_nodes
        groups: dict[tuple, list[tuple[str, int, int]]] = {}  # (node, group) -> [(role, rank, units)]
        for role, count in ranks.items():
            units = gpus_per_engine if role == "engine" else 1
            side = "engines" if role in ("engine", "judge") else "training"
            for rank in range(count):
                node = nodes[self.bundle_of(role, rank)]
                # a judge computes while the engines generate (rewards are scored as samples finish)
                together = side if overlap else ("engine" if role == "judge" else role)
                groups.setdefault((node, together), []).append((role, rank, units))
        node_units: dict = {}
        for (node, _), members in groups.items():
            node_units[node] = node_units.get(node, 0) + sum(u for *_, u in members)
        shares, node_first = {}, {}
        for (node, _), members in sorted(groups.items(), key=lambda item: item[0][1] != "training"):
            group_units = sum(u for *_, u in members)
            if overlap:
                group = {"group_first": node_first.get(node, 0), "group_units": group_units,
                         "group_total": node_units[node]}
                node_first[node] = node_first.get(node, 0) + group_units
            else:
                group = {}
            first = 0
            for role, rank, units in members:
                shares[(role, rank)] = CpuShare(first, units, group_units, **group)
                first += units
        return shares

    def describe(self) -> str:
        """Which node (its address and the start of its id) holds each rank of each role, for the run's log."""
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        parts = []
        for role, count in self.ranks.items():
            if count:
                nodes = [self.bundle_nodes[self.bundle_of(role, rank)] for rank in range(count)]
                parts.append(f"{role} ranks on " + ", ".join(f"{address.get(n, '?')}/{n[:8]}" for n in nodes))
        return "; ".join(parts)

    def actor_options(self, index: int) -> dict:
        """Ray options for an actor on bundle `index`, asking for its share of the bundle's resources."""
        options = {"num_cpus": self.share, "scheduling_strategy": bundle_strategy(self.pg, index)}
        if self.gpus:
            options["num_gpus"] = self.share
        return options


@ray.remote(num_cpus=0, num_gpus=0.01)
def _gpu_ids() -> list[str]:
    return [str(gpu) for gpu in ray.get_gpu_ids()]


# memory of a GPU model, GiB, by Ray's accelerator type (ray.util.accelerators names)
GPU_MEMORY_GIB = {"H200": 141.0, "H100": 80.0, "H800": 80.0, "H20": 96.0, "A100-80G": 80.0, "A100-40G": 40.0,
                  "A800": 80.0, "L40S": 48.0, "L4": 24.0, "A10G": 24.0, "B200": 180.0, "GB200": 186.0}


def cluster_gpu_memory_gib() -> float | None:
    """The memory of the cluster's smallest GPU model that Ray names (its `accelerator_type:*` resources), or None
    where none is known."""
    types = [key.split(":", 1)[1] for key in ray.cluster_resources() if key.startswith("accelerator_type:")]
    known = [GPU_MEMORY_GIB[t] for t in types if t in GPU_MEMORY_GIB]
    return min(known) if known else None


def check_on_cluster_devices(args, train: bool) -> None:
    """What only the cluster's devices decide, before any trainer or engine starts: the transports' placement
    rules, and on GPUs the memory plan (a layout that cannot fit is refused, naming the flags that would fit)."""
    from vime.arguments import validate_transport_placement
    from vime.plan.run_plan import check_memory_plan

    gpus = cluster_has_gpus()
    validate_transport_placement(args, gpus=gpus)
    if gpus and train:
        check_memory_plan(args, PlacementConfig.of(args).gpu_memory_gib or cluster_gpu_memory_gib())


def bundle_gpu_ids(pg, n_bundles: int) -> list[str]:
    """The GPU id of every bundle of `pg`, as its node numbers them: a sliver of each bundle's GPU is asked for,
    and Ray hands out that bundle's GPU (a bundle keeps its GPU for the placement group's life)."""
    ids = ray.get([_gpu_ids.options(scheduling_strategy=bundle_strategy(pg, b)).remote() for b in range(n_bundles)],
                  timeout=120)
    return [gpus[0] for gpus in ids]


def device_order(nodes: list[str], gpus: list[str | None]) -> list[int]:
    """Bundle indices sorted by node (in order of first appearance) then GPU id: consecutive slots of a node are
    its GPUs in order, so an engine of k GPUs takes k GPUs of one node whenever nodes hold multiples of k."""
    first_seen = {node: i for i, node in reversed(list(enumerate(nodes)))}

    def key(bundle: int):
        gpu = gpus[bundle]
        return first_seen[nodes[bundle]], (int(gpu) if gpu is not None and gpu.isdigit() else bundle, str(gpu))
    return sorted(range(len(nodes)), key=key)


def on_this_node() -> dict:
    """Ray options that place an actor on the calling process's node: the rollout manager (and the router it
    starts) stays on the driver's node, whichever node of a cluster has room."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                  soft=False)}


def bundle_strategy(pg, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=True)
