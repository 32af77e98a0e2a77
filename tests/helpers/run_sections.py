"""The components a run builds from its `RunConfig`'s sections (`TrainingSession`), built here from a slime-style
namespace: a test's parsed flags, or a partial namespace whose missing flags take their defaults (`Section.of`)."""

from __future__ import annotations

from vime.config.agents import JudgeConfig
from vime.config.algorithm import AlgorithmConfig
from vime.config.rollout import EnginesConfig, FaultToleranceConfig, RolloutConfig
from vime.config.run import JobConfig, PlacementConfig
from vime.config.train import LoraConfig


def placement_of(args, **options):
    """`Placement` of `args`; `options`: with_engines, with_trainers, overlap."""
    from vime.driver.placement import Placement

    return Placement(PlacementConfig.of(args), EnginesConfig.of(args), JudgeConfig.of(args),
                     use_critic=AlgorithmConfig.of(args).use_critic, **options)


def init_ray_of(args) -> None:
    from vime.driver.placement import init_ray

    init_ray(JobConfig.of(args), PlacementConfig.of(args), EnginesConfig.of(args), JudgeConfig.of(args))


def weight_sync_of(args):
    """The driver-side `WeightSync` of `args`, as the session makes it."""
    from vime.transport.weights.base import DriverSetup
    from vime.driver.weight_sync import WeightSync

    return WeightSync(DriverSetup.of(args), LoraConfig.of(args),
                      recovery_copies=FaultToleranceConfig.of(args).use_fault_tolerance,
                      rollout_timeout=RolloutConfig.of(args).rollout_timeout,
                      train_timeout=JobConfig.of(args).train_timeout)
