"""GPU placement without GPUs: Ray hands out logical GPUs and sets CUDA_VISIBLE_DEVICES for them as for real ones,
so what each training rank and engine would see is checked here on simulated GPU nodes. Training ranks are started
by the real training group; engines' servers get the environment the real `engine_env` builds, computed inside
actors placed as the fleet places them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.helpers.run_sections import placement_of
from vime.driver.placement import Placement, device_order

GPUS_PER_NODE = 4


# Tasks, not actors, stand in for ranks and engines: Ray sets CUDA_VISIBLE_DEVICES for a task as for an actor with
# the same options, and reuses idle worker processes for tasks (each actor would start a process of its own).
@ray.remote
def rank_sees() -> dict:
    import os

    return {"node": ray.get_runtime_context().get_node_id(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


@ray.remote
def engine_sees(gpus: list[str]) -> dict:
    """What the real `engine_env` shows the vLLM server of an engine placed here."""
    import os

    from vime.engine.control.engine import engine_env

    args = SimpleNamespace(rollout_num_gpus_per_engine=len(gpus), cpu_kv_cache_space=1, update_weight_dir=None,
                           save=None)
    return {"node": ray.get_runtime_context().get_node_id(), "actor": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "server": engine_env(args, "token", gpus=gpus)["CUDA_VISIBLE_DEVICES"]}


@pytest.fixture(scope="module")
def gpu_cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "num_gpus": GPUS_PER_NODE})
    c.add_node(num_cpus=8, num_gpus=GPUS_PER_NODE)
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


def _args(**kw):
    base = dict(actor_num_nodes=1, actor_num_gpus_per_node=1, rollout_num_gpus=1, rollout_num_gpus_per_engine=1,
                rollout_external_engine_addrs=None, colocate=False, use_critic=False, train_num_threads=None,
                data_transport="object_store", ray_address=None, judge_checkpoint=None, judge_num_engines=1)
    base.update(kw)
    return SimpleNamespace(**base)


def _ranks(placement: Placement, role: str = "actor") -> list[dict]:
    """(node, what the rank sees, its LOCAL_RANK) for every `role` rank placed as the training group places it."""
    seen = ray.get([rank_sees.options(**placement.actor_options(placement.bundle_of(role, r))).remote()
                    for r in range(placement.ranks[role])])
    return [{**s, "local_rank": placement.local_rank(role, r)} for r, s in enumerate(seen)]


def _trainers(placement: Placement, args, role: str = "actor") -> list[dict]:
    """(node, what the rank sees) for every rank of a real training group on `placement`."""
    from vime.driver.train_group import RayTrainGroup

    group = RayTrainGroup(args, placement, role=role)
    try:
        seen = ray.get([a.devices.remote() for a in group.actors])
        nodes = ray.get([a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                         for a in group.actors])
        return [{**s, "node": n} for s, n in zip(seen, nodes)]
    finally:
        group.shutdown()


def _engines(placement: Placement, role: str = "engine") -> list[dict]:
    gpus = placement.engine_gpus if role == "engine" else placement.judge_gpus
    return ray.get([engine_sees.options(**placement.actor_options(placement.bundle_of(role, r))).remote(gpus(r))
                    for r in range(placement.ranks[role])])


def _gpus(seen: dict) -> set[tuple[str, str]]:
    return {(seen["node"], g) for g in seen["server"].split(",")}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_disaggregated_engines_own_their_tensor_parallel_gpus(gpu_cluster, tp):
    # 4 training ranks (DP) and 4 engine GPUs over two 4-GPU nodes
    args = _args(actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=tp)
    p = placement_of(args)
    try:
        ranks, engines = _ranks(p), _engines(p)
    finally:
        ray.util.remove_placement_group(p.pg)
    assert len(engines) == 4 // tp
    for rank in ranks:  # one GPU each, as Ray shows it
        assert rank["visible"] is not None and len(rank["visible"].split(",")) == 1
    rank_gpus = {(r["node"], r["visible"]) for r in ranks}
    assert len(rank_gpus) == 4  # no two ranks on one GPU
    for node in {r["node"] for r in ranks}:  # LOCAL_RANK counts the ranks of each node from 0
        assert sorted(r["local_rank"] for r in ranks if r["node"] == node) == list(range(
            sum(r["node"] == node for r in ranks)))
    engine_gpus = [_gpus(e) for e in engines]
    for seen, gpus in zip(engines, engine_gpus):
        assert len(gpus) == tp  # every worker of the engine gets a GPU of the engine's own node
        assert seen["actor"] in seen["server"].split(",")  # the actor sits on one of its server's GPUs
    every = set().union(*engine_gpus)
    assert len(every) == 4 and not every & rank_gpus  # engines never share a GPU with each other or a trainer


@pytest.mark.parametrize("colocate", [False, True])
def test_the_judges_engines_get_gpus_of_their_own(gpu_cluster, colocate):
    """--judge-checkpoint: each judge engine serves on one GPU that no trainer, policy engine or other judge has,
    whether the policy's engines share the trainers' GPUs or not."""
    args = _args(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=colocate, judge_checkpoint="judge",
                 judge_num_engines=2)
    p = placement_of(args)
    try:
        assert p.ranks["judge"] == 2 and len(p.pg.bundle_specs) == (2 if colocate else 4) + 2
        ranks, engines, judges = _ranks(p), _engines(p), _engines(p, "judge")
    finally:
        ray.util.remove_placement_group(p.pg)
    policy = {(r["node"], r["visible"]) for r in ranks} | set().union(*map(_gpus, engines))
    assert len(policy) == (2 if colocate else 4)
    judge_gpus = [_gpus(j) for j in judges]
    assert all(len(g) == 1 for g in judge_gpus) and not judge_gpus[0] & judge_gpus[1]
    assert not set().union(*judge_gpus) & policy
    assert all(j["actor"] == j["server"] for j in judges)  # the actor sits on the GPU its server uses


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_colocated_engines_use_the_training_ranks_gpus(gpu_cluster, tp):
    args = _args(actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=tp, colocate=True)
    p = placement_of(args)
    try:
        assert len(p.pg.bundle_specs) == 4 and p.share == 0.5
        ranks, engines = _ranks(p), _engines(p)
    finally:
        ray.util.remove_placement_group(p.pg)
    rank_gpus = [(r["node"], r["visible"]) for r in ranks]
    assert len(set(rank_gpus)) == 4 and len({n for n, _ in rank_gpus}) == 1  # PACK: one node holds them all
    for r, seen in enumerate(engines):  # engine r shares exactly the GPUs of training ranks r*tp .. r*tp+tp-1
        assert _gpus(seen) == set(rank_gpus[r * tp:(r + 1) * tp])
    assert sorted(r["local_rank"] for r in ranks) == [0, 1, 2, 3]


def test_two_node_trainer_and_ppo_critic_each_get_their_own_gpus(gpu_cluster):
    # 2 nodes x 2 ranks for the actor, as many for the critic, on 8 GPUs: every rank its own GPU
    args = _args(actor_num_nodes=2, actor_num_gpus_per_node=2, rollout_num_gpus=0, use_critic=True)
    p = placement_of(args, with_engines=False)
    try:
        actors, critics = _trainers(p, args), _trainers(p, args, role="critic")
    finally:
        ray.util.remove_placement_group(p.pg)
    every = [(r["node"], r["visible"]) for r in actors + critics]
    assert len(set(every)) == 8 and len({n for n, _ in every}) == 2
    for group in (actors, critics):
        for node in {r["node"] for r in group}:
            local = sorted(r["local_rank"] for r in group if r["node"] == node)
            assert local == list(range(len(local)))


def test_an_engine_cannot_span_nodes(gpu_cluster):
    # 3 trainers take 3 GPUs of the first node; a 2-GPU engine on the last GPU of one node and the first of the
    # next would be a vLLM server across nodes: refused while placing, with what to do
    with pytest.raises(ValueError, match="on different nodes.*multiple of --rollout-num-gpus-per-engine"):
        placement_of(_args(actor_num_gpus_per_node=3, rollout_num_gpus=4, rollout_num_gpus_per_engine=2))
    # the refused placement gave its GPUs back
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_device_order_groups_each_nodes_gpus():
    # PACK may interleave nodes in bundle order; slots follow (node, GPU id)
    nodes, gpus = ["b", "a", "b", "a", "b"], ["2", "1", "0", "0", "1"]
    assert device_order(nodes, gpus) == [2, 4, 0, 3, 1]
    assert device_order(["x", "x"], [None, None]) == [0, 1]  # CPU bundles keep their order


def test_device_index_follows_what_the_rank_sees():
    from vime.trainer.megatron.parallel import device_index

    assert device_index(3, 1) == 0  # Ray showed the rank its bundle's GPU alone
    assert device_index(3, 8) == 3  # torchrun: every GPU visible, LOCAL_RANK names one
    with pytest.raises(ValueError, match="LOCAL_RANK 8 names no GPU"):
        device_index(8, 8)


def test_ranks_without_a_placement_group_get_the_clusters_gpus(gpu_cluster):
    """A training group made without a placement group asks for a GPU per rank because the cluster has GPUs, though
    this driver has none (it once asked the driver's own devices, and put GPU ranks on no GPU)."""
    from vime.driver.train_group import RayTrainGroup
    from vime.utils.device import use_gpu

    assert not use_gpu()
    group = RayTrainGroup(_args(actor_num_gpus_per_node=2), None)
    try:
        seen = ray.get([a.devices.remote() for a in group.actors])
    finally:
        group.shutdown()
    assert all(s["visible"] not in (None, "") for s in seen) and len({s["visible"] for s in seen}) == 2, seen
