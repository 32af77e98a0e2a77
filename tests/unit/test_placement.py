"""Placement on a simulated multi-node Ray cluster: bundles, offsets and fractional shares for disaggregated
and colocated runs, with small stand-in actors (placement is what is tested here, not the engines)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.helpers.run_sections import placement_of
from vime.driver.placement import Placement
from vime.utils.cpus import CpuShare


@ray.remote
class WhereAmI:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    c.add_node(num_cpus=2)
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


def _args(**kw):
    base = dict(actor_num_nodes=2, actor_num_gpus_per_node=1, rollout_num_gpus=2, rollout_num_gpus_per_engine=1,
                rollout_external_engine_addrs=None,
                colocate=False, use_critic=False, judge_checkpoint=None, judge_num_engines=1)
    base.update(kw)
    return SimpleNamespace(**base)


def _nodes(placement: Placement, bundles: list[int]) -> list[str]:
    actors = [WhereAmI.options(**placement.actor_options(b)).remote() for b in bundles]
    nodes = ray.get([a.node.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    return nodes


def test_disaggregated_spans_nodes(cluster):
    p = placement_of(_args())
    assert (p.actor_offset, p.rollout_offset, p.share) == (0, 2, 1.0)
    assert len(p.pg.bundle_specs) == 4
    nodes = _nodes(p, [0, 1, 2, 3])  # 2 trainers + 2 engines, 1 CPU each: more than one 2-CPU node holds
    assert len(set(nodes)) >= 2
    ray.util.remove_placement_group(p.pg)


def test_colocated_shares_bundles(cluster):
    p = placement_of(_args(colocate=True))
    assert (p.actor_offset, p.rollout_offset, p.share) == (0, 0, 0.5)
    assert len(p.pg.bundle_specs) == 2
    trainer_nodes = _nodes(p, [0, 1])
    both = [WhereAmI.options(**p.actor_options(b)).remote() for b in (0, 0, 1, 1)]  # trainer + engine per bundle
    nodes = ray.get([a.node.remote() for a in both])
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3]
    assert {nodes[0], nodes[2]} == set(trainer_nodes)
    for a in both:
        ray.kill(a)
    ray.util.remove_placement_group(p.pg)


def test_ppo_critic_gets_its_own_bundles(cluster):
    p = placement_of(_args(use_critic=True, actor_num_nodes=1))
    assert (p.critic_offset, p.rollout_offset, len(p.pg.bundle_specs)) == (1, 2, 4)
    ray.util.remove_placement_group(p.pg)
    p = placement_of(_args(use_critic=True, colocate=True))
    assert (p.critic_offset, p.rollout_offset, p.share) == (0, 0, pytest.approx(1 / 3))
    ray.util.remove_placement_group(p.pg)


def test_external_engines_take_no_bundles(cluster):
    p = placement_of(_args(rollout_external_engine_addrs=["127.0.0.1:1"]))
    assert len(p.pg.bundle_specs) == 2
    ray.util.remove_placement_group(p.pg)


def test_engines_on_one_node_split_its_cpus(cluster):
    from vime.engine.control.engine import engine_env, omp_bind_value

    p = placement_of(_args(actor_num_nodes=1, rollout_num_gpus=4))  # 1 trainer + 4 engines on 2-CPU nodes
    nodes = _nodes(p, [p.bundle_of("engine", r) for r in range(4)])
    for rank in range(4):  # an equal share among the engines that really share its node
        share = p.cpu_share("engine", rank)
        assert share.total == nodes.count(nodes[rank]) and share.first == nodes[:rank].count(nodes[rank])
    ray.util.remove_placement_group(p.pg)

    assert [CpuShare(i, 1, 2).cpus([0, 1]) for i in range(2)] == [[0], [1]]
    assert [CpuShare(i, 1, 2).cpus([0, 1, 2, 3, 4]) for i in range(2)] == [[0, 1, 2], [3, 4]]
    assert [CpuShare(i, 1, 3).cpus([4, 5]) for i in range(3)] == [[4], [5], [4]]  # more engines than CPUs
    assert CpuShare(1, 2, 3).cpus(list(range(6))) == [2, 3, 4, 5]  # a 2-worker engine's run of two units
    assert omp_bind_value([0, 1, 2, 3], 2) == "0,1|2,3" and omp_bind_value([6], 2) == "6|6"
    args = SimpleNamespace(rollout_num_gpus_per_engine=1, cpu_kv_cache_space=1)
    token_file = "token"  # where a server would read the run's token: only named here
    every = sorted(os.sched_getaffinity(0))
    # alone on its node: all of it (vLLM's own binding would keep a core for its front end)
    assert engine_env(args, token_file, CpuShare(0, 1, 1))["VLLM_CPU_OMP_THREADS_BIND"] == omp_bind_value(every, 1)
    bound = engine_env(args, token_file, CpuShare(1, 1, 2))
    assert bound["VLLM_CPU_OMP_THREADS_BIND"] == omp_bind_value(CpuShare(1, 1, 2).cpus(every), 1)
    # one worker: inside the engine core, its OpenMP team bound to the share (whatever OMP_NUM_THREADS Ray set)
    mine = CpuShare(1, 1, 2).cpus(every)
    assert bound["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and bound["OMP_PROC_BIND"] == "true"
    assert bound["OMP_NUM_THREADS"] == str(len(mine)) and bound["OMP_PLACES"] == "{%s}" % ",".join(map(str, mine))
    assert bound["VIME_ENGINE_CORE_FORK"] == "1"  # its engine core forked from the API server, not spawned
    two = engine_env(SimpleNamespace(rollout_num_gpus_per_engine=2, cpu_kv_cache_space=1), token_file)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in two and two["VLLM_CPU_OMP_THREADS_BIND"] == omp_bind_value(every, 2)
    assert "VIME_ENGINE_CORE_FORK" not in two  # worker processes keep the spawn vLLM's CPU platform wants


def _train_args(**kw):
    return SimpleNamespace(**{**vars(_args(actor_num_nodes=1, rollout_num_gpus=1)), "train_num_threads": None, **kw})


def _rank_threads(placement, args) -> tuple[int, list[int]]:
    """(torch threads, CPUs) of training rank 0 as started by the real training group on `placement`."""
    from vime.driver.train_group import RayTrainGroup

    group = RayTrainGroup(args, placement)
    try:
        return ray.get(group.actors[0].compute_threads.remote())
    finally:
        group.shutdown()


def test_training_ranks_compute_on_the_cpus_the_placement_gives_them(cluster):
    every = sorted(os.sched_getaffinity(0))
    # synchronous loop, one node: training and generation take turns, so the training rank gets every CPU
    sync = placement_of(_train_args())
    assert sync.cpu_share("actor", 0) == CpuShare(0, 1, 1) == sync.cpu_share("engine", 0)
    assert _rank_threads(sync, _train_args()) == (len(every), every)
    # --train-num-threads overrides the count (and pins nothing)
    assert _rank_threads(sync, _train_args(train_num_threads=3)) == (3, every)
    ray.util.remove_placement_group(sync.pg)

    # train_async: the phases overlap, so the training side and the engines split the node
    overlap = placement_of(_train_args(), overlap=True)
    mine, engine = overlap.cpu_share("actor", 0), overlap.cpu_share("engine", 0)
    assert (mine, engine) == (CpuShare(0, 1, 1, 0, 1, 2), CpuShare(0, 1, 1, 1, 1, 2))
    assert _rank_threads(overlap, _train_args()) == (len(mine.cpus(every)), mine.cpus(every))
    if len(every) > 1:
        assert mine.cpus(every) and not set(mine.cpus(every)) & set(engine.cpus(every))
    ray.util.remove_placement_group(overlap.pg)


def test_overlapping_phases_cut_the_node_between_training_and_engines():
    # 2 CPUs, 1 training rank, 2 engines (the quickstart under train_async): a CPU each side, engines share theirs
    training, engines = CpuShare(0, 1, 1, 0, 1, 3), [CpuShare(i, 1, 2, 1, 2, 3) for i in range(2)]
    assert training.cpus([0, 1]) == [0] and [e.cpus([0, 1]) for e in engines] == [[1], [1]]
    # 16 CPUs, 8 ranks and 8 one-worker engines: 8 CPUs a side, one CPU a process
    ranks = [CpuShare(i, 1, 8, 0, 8, 16).cpus(list(range(16))) for i in range(8)]
    assert ranks[0] == [0] and ranks[7] == [7]
    assert CpuShare(1, 2, 4, 4, 4, 8).cpus(list(range(16))) == [10, 11, 12, 13]  # a 2-worker engine, 2nd half
    assert CpuShare(0, 1, 1, 1, 1, 2).cpus([5]) == [5]  # one CPU: both sides time-share it
