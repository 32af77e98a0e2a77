"""vime's training-loop flags (how a rollout becomes optimizer steps), beside Megatron's own."""

from __future__ import annotations

import argparse


def add_train_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training loop")
    g.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="Optimizer steps per rollout; sets --global-batch-size to the rollout's samples divided "
                        "by it (default: 1 step, or from --global-batch-size).")
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="Cut micro-batches by padded tokens (--max-tokens-per-gpu) instead of sample count "
                        "(default: off).")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="Padded tokens per micro-batch with --use-dynamic-batch-size (default: None).")
    g.add_argument("--update-weight-transport", default="disk", choices=["disk"],
                   help="How new weights reach the engines: disk = HF safetensors the engines reload "
                        "(default: disk).")
    g.add_argument("--update-weight-dir", default=None,
                   help="Directory for the disk transport; must be visible to the engines (default: /dev/shm).")
    g.add_argument("--save-hf", default=None,
                   help="Path template with {rollout_id}: also export HF safetensors when saving (default: None).")


def validate_train_args(args: argparse.Namespace) -> None:
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        if samples % args.num_steps_per_rollout:
            raise ValueError(f"--num-steps-per-rollout {args.num_steps_per_rollout} does not divide the "
                             f"{samples} samples of a rollout (rollout-batch-size x n-samples-per-prompt)")
        gbs = samples // args.num_steps_per_rollout
        if args.global_batch_size is not None and args.global_batch_size != gbs:
            raise ValueError(f"--global-batch-size {args.global_batch_size} contradicts --num-steps-per-rollout "
                             f"{args.num_steps_per_rollout} ({samples} samples per rollout -> {gbs}); give one")
        args.global_batch_size = gbs
    elif args.global_batch_size is None:
        args.global_batch_size = samples
    if samples % args.global_batch_size:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must divide the {samples} samples of a "
                         "rollout (rollout-batch-size x n-samples-per-prompt)")
    args.num_steps_per_rollout = samples // args.global_batch_size
    if args.use_dynamic_batch_size and not args.max_tokens_per_gpu:
        raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu N")
