"""vime's synchronous RL loop: generate -> train -> save -> update weights -> eval.

    python train.py --hf-checkpoint DIR --prompt-data data.jsonl --rm-type math ...

`--debug-rollout-only` runs the rollout half alone (engines, router, rewards, saved rollouts);
`--debug-train-only --load-debug-rollout-data PATH` trains on saved rollouts without engines.
"""

from __future__ import annotations

import logging

import ray

from vime.backends.weight_transport import update_weights
from vime.ray.actor_group import RayTrainGroup
from vime.ray.placement import create_rollout_placement_group, init_ray
from vime.ray.rollout_manager import RolloutManager
from vime.utils.arguments import parse_args
from vime.utils.logging_utils import MetricsLogger, configure_logging, progress
from vime.utils.plot import save_reward_curve


def resolve_num_rollout(args, num_prompts: int) -> int:
    if args.num_rollout is not None:
        return args.num_rollout
    if args.num_epoch is not None:
        return max(1, args.num_epoch * num_prompts // args.rollout_batch_size)
    raise ValueError("set --num-rollout or --num-epoch")


def should_save(args, rollout_id: int, num_rollout: int) -> bool:
    if not args.save:
        return False
    last = rollout_id + 1 == num_rollout
    return last or bool(args.save_interval and (rollout_id + 1) % args.save_interval == 0)


def train(args) -> None:
    init_ray(args)
    use_engines = not args.debug_train_only
    rollout_pg = create_rollout_placement_group(args) if use_engines and not args.rollout_external_engine_addrs \
        else None
    manager = RolloutManager.remote(args, rollout_pg)
    trainers = None if args.debug_rollout_only else RayTrainGroup(args)
    metrics_logger = MetricsLogger(args)
    try:
        if use_engines:
            ray.get(manager.start.remote())
        num_rollout = resolve_num_rollout(args, ray.get(manager.num_prompts.remote()))
        start_rollout_id = 0
        if trainers is not None:
            trainers.init(total_steps=num_rollout * args.num_steps_per_rollout)
            resumed = trainers.call("get_loaded_state")[0]
            if resumed:  # continue after the saved rollout, with the same data order
                start_rollout_id = resumed["rollout_id"] + 1
                ray.get(manager.load_data_source_state.remote(resumed.get("data_source")))
            if use_engines:  # engines serve exactly the trainer's weights from the first rollout on
                update_weights(args, trainers, manager, version=start_rollout_id)

        def evaluate(rollout_id):
            if use_engines and args.eval_interval:
                metrics_logger.log(rollout_id, ray.get(manager.eval.remote(rollout_id)))

        for rollout_id in progress(range(start_rollout_id, num_rollout), desc="rollouts",
                                   initial=start_rollout_id, total=num_rollout):
            if args.eval_interval and rollout_id % args.eval_interval == 0:
                evaluate(rollout_id)
            groups, metrics = ray.get(manager.generate.remote(rollout_id))
            if trainers is not None:
                metrics.update(trainers.train(rollout_id, groups))
                if should_save(args, rollout_id, num_rollout):
                    state = {"data_source": ray.get(manager.data_source_state.remote())}
                    trainers.call("save", rollout_id, state)
                if args.save_hf and (should_save(args, rollout_id, num_rollout) or rollout_id + 1 == num_rollout):
                    trainers.call("save_hf", args.save_hf.format(rollout_id=rollout_id))
                if use_engines:
                    metrics.update(update_weights(args, trainers, manager, version=rollout_id + 1))
            metrics_logger.log(rollout_id, metrics)
        if args.eval_interval:
            evaluate(num_rollout)
    finally:
        try:
            ray.get(manager.shutdown.remote(), timeout=120)
        finally:
            if trainers is not None:
                trainers.shutdown()
            metrics_logger.close()
            save_reward_curve(args.output_dir)


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
