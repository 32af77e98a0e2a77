"""vime's synchronous RL loop: generate -> train -> save -> update weights -> eval.

    python train.py --hf-checkpoint DIR --prompt-data data.jsonl --rm-type math ...

`--debug-rollout-only` runs the rollout half alone (engines, router, rewards, saved rollouts).
"""

from __future__ import annotations

import logging

import ray

from vime.ray.placement import create_rollout_placement_group, init_ray
from vime.ray.rollout_manager import RolloutManager
from vime.utils.arguments import parse_args
from vime.utils.logging_utils import MetricsLogger, configure_logging, progress


def resolve_num_rollout(args, num_prompts: int) -> int:
    if args.num_rollout is not None:
        return args.num_rollout
    if args.num_epoch is not None:
        return max(1, args.num_epoch * num_prompts // args.rollout_batch_size)
    raise ValueError("set --num-rollout or --num-epoch")


def train(args) -> None:
    init_ray(args)
    rollout_pg = None if args.rollout_external_engine_addrs else create_rollout_placement_group(args)
    manager = RolloutManager.remote(args, rollout_pg)
    metrics_logger = MetricsLogger(args)
    try:
        ray.get(manager.start.remote())
        num_rollout = resolve_num_rollout(args, ray.get(manager.num_prompts.remote()))
        if not args.debug_rollout_only:
            raise NotImplementedError("training is not wired into train.py yet; run with --debug-rollout-only")
        for rollout_id in progress(range(num_rollout), desc="rollouts"):
            if args.eval_interval and rollout_id % args.eval_interval == 0:
                metrics_logger.log(rollout_id, ray.get(manager.eval.remote(rollout_id)))
            _, metrics = ray.get(manager.generate.remote(rollout_id))
            metrics_logger.log(rollout_id, metrics)
        if args.eval_interval:
            metrics_logger.log(num_rollout, ray.get(manager.eval.remote(num_rollout)))
    finally:
        try:
            ray.get(manager.shutdown.remote(), timeout=120)
        finally:
            metrics_logger.close()


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    args = parse_args(argv)
    try:
        train(args)
    finally:
        ray.shutdown()
    logging.getLogger("vime").info("done: metrics in %s/metrics.jsonl", args.output_dir)


if __name__ == "__main__":
    main()
