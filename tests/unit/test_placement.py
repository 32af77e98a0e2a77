"""Placement on a simulated multi-node Ray cluster: bundles, offsets and fractional shares for disaggregated
and colocated runs, with small stand-in actors (placement is what is tested here, not the engines)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import ray
from ray.cluster_utils import Cluster

from vime.ray.placement import Placement


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
    base = dict(actor_num_nodes=2, actor_num_gpus_per_node=1, rollout_num_gpus=2, rollout_external_engine_addrs=None,
                colocate=False, use_critic=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _nodes(placement: Placement, bundles: list[int]) -> list[str]:
    actors = [WhereAmI.options(**placement.actor_options(b)).remote() for b in bundles]
    nodes = ray.get([a.node.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    return nodes


def test_disaggregated_spans_nodes(cluster):
    p = Placement(_args())
    assert (p.actor_offset, p.rollout_offset, p.share) == (0, 2, 1.0)
    assert len(p.pg.bundle_specs) == 4
    nodes = _nodes(p, [0, 1, 2, 3])  # 2 trainers + 2 engines, 1 CPU each: more than one 2-CPU node holds
    assert len(set(nodes)) >= 2
    ray.util.remove_placement_group(p.pg)


def test_colocated_shares_bundles(cluster):
    p = Placement(_args(colocate=True))
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
    p = Placement(_args(use_critic=True, actor_num_nodes=1))
    assert (p.critic_offset, p.rollout_offset, len(p.pg.bundle_specs)) == (1, 2, 4)
    ray.util.remove_placement_group(p.pg)
    p = Placement(_args(use_critic=True, colocate=True))
    assert (p.critic_offset, p.rollout_offset, p.share) == (0, 0, pytest.approx(1 / 3))
    ray.util.remove_placement_group(p.pg)


def test_external_engines_take_no_bundles(cluster):
    p = Placement(_args(rollout_external_engine_addrs=["127.0.0.1:1"]))
    assert len(p.pg.bundle_specs) == 2
    ray.util.remove_placement_group(p.pg)


def test_engines_on_one_node_split_its_cpus(cluster):
    from vime.backends.vllm_utils.engine import engine_cpus, engine_env, omp_bind_value

    p = Placement(_args(actor_num_nodes=1, rollout_num_gpus=4))  # 1 trainer + 4 engines on 2-CPU nodes
    slots = p.engine_cpu_slots(4, 1)
    nodes = _nodes(p, [p.engine_bundle(r, 1) for r in range(4)])
    for rank, (index, count) in enumerate(slots):  # index among the engines that really share its node
        assert count == nodes.count(nodes[rank]) and index == nodes[:rank].count(nodes[rank])
    ray.util.remove_placement_group(p.pg)

    assert [engine_cpus([0, 1], i, 2) for i in range(2)] == [[0], [1]]
    assert [engine_cpus([0, 1, 2, 3, 4], i, 2) for i in range(2)] == [[0, 1, 2], [3, 4]]
    assert [engine_cpus([4, 5], i, 3) for i in range(3)] == [[4], [5], [4]]  # more engines than CPUs
    assert omp_bind_value([0, 1, 2, 3], 2) == "0,1|2,3" and omp_bind_value([6], 2) == "6|6"
    args = SimpleNamespace(rollout_num_gpus_per_engine=1, cpu_kv_cache_space=1)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(args, (0, 1))  # alone on its node: vLLM's own binding
    bound = engine_env(args, (1, 2))["VLLM_CPU_OMP_THREADS_BIND"]
    assert bound == omp_bind_value(engine_cpus(sorted(os.sched_getaffinity(0)), 1, 2), 1)
