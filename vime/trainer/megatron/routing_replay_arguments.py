"""Flags of MoE routing replay (`vime.trainer.routing_replay`), apart from its torch code: parsing imports no torch."""

from __future__ import annotations

import argparse

from vime.config.rollout import EnginesConfig
from vime.config.run import JobConfig
from vime.config.section import add_flags
from vime.config.train import RoutingReplayConfig
from vime.trainer.megatron.hf_architecture import hf_moe


def add_routing_replay_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("MoE routing replay")
    add_flags(g, RoutingReplayConfig)


def validate_routing_replay_args(args: argparse.Namespace, hf_config=None) -> None:
    """Parse-time checks. `hf_config`: the checkpoint's (read from --hf-checkpoint when None and a flag is set)."""
    job = JobConfig.of(args)
    routing_replay = RoutingReplayConfig.of(args)
    flags = [name for name, on in (("use_rollout_routing_replay", routing_replay.use_rollout_routing_replay),
                                   ("use_routing_replay", routing_replay.use_routing_replay)) if on]
    if not flags:
        return
    if hf_config is None:
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(job.hf_checkpoint)
        except Exception as e:  # transformers' own checks raise KeyError, ValueError, OSError, ...
            raise ValueError(f"--hf-checkpoint {job.hf_checkpoint}: transformers cannot read its config.json "
                             f"({type(e).__name__}: {e})") from e
    names = " and ".join("--" + f.replace("_", "-") for f in flags)
    if not hf_moe(hf_config)["num_experts"]:
        raise ValueError(f"{names}: {job.hf_checkpoint} is a dense model (no routed experts in its config.json); "
                         "routing replay is for MoE models, drop the flag")
    # on CPU rollout routing replay needs one-worker engines: checked once Ray knows the cluster's devices
    # (`rollout_replay_on_devices`, from the session), not by the driver's own, which may be a CPU-only head node


def rollout_replay_on_devices(args, gpus: bool | None) -> None:
    """--use-rollout-routing-replay on CPU engines (`gpus` False): vime captures the routing in the engine's
    worker, so engines of one worker only. None (devices unknown yet): nothing to refuse."""
    if gpus is False and RoutingReplayConfig.of(args).use_rollout_routing_replay \
            and EnginesConfig.of(args).rollout_num_gpus_per_engine != 1:
        raise ValueError("--use-rollout-routing-replay on CPU: vime captures the routing in the engine's worker, for "
                         "engines of one worker; set --rollout-num-gpus-per-engine 1")
