"""Ray start-up and placement groups for rollout engines (and, later, training actors).

On GPU machines a bundle is one GPU; on CPU machines the same code uses CPU bundles, one per engine slot.
Ray's CPU counts are logical here: vLLM and torch manage their own threads.
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def use_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def init_ray(args) -> None:
    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}}
    if args.ray_address:
        ray.init(address=args.ray_address, runtime_env=env, log_to_driver=True)
        return
    # A local cluster stays on loopback: engines and their control routes are never exposed to a network.
    slots = args.rollout_num_gpus + args.actor_num_nodes * args.actor_num_gpus_per_node + 2
    ray.init(num_cpus=max(os.cpu_count() or 1, slots), runtime_env=env, include_dashboard=False,
             log_to_driver=True, _node_ip_address="127.0.0.1")


def serving_host(args) -> str:
    """Address engines and the router bind to: this node's address on a cluster, loopback otherwise."""
    if getattr(args, "ray_address", None) and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def num_engines(args) -> int:
    if args.rollout_external_engine_addrs:
        return len(args.rollout_external_engine_addrs)
    return args.rollout_num_gpus // args.rollout_num_gpus_per_engine


def create_rollout_placement_group(args):
    """One bundle per engine (GPU: --rollout-num-gpus-per-engine GPUs; CPU: one CPU slot)."""
    n = num_engines(args)
    if use_gpu():
        bundle = {"GPU": args.rollout_num_gpus_per_engine, "CPU": 1}
    else:
        bundle = {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    ray.get(pg.ready(), timeout=600)
    return pg


def bundle_strategy(pg, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=True)
