"""The components a run builds from its `RunConfig`'s sections (`TrainingSession`), built here from a slime-style
namespace: a test's parsed flags, or a partial namespace whose missing flags take their defaults (`Section.of`)."""

from __future__ import annotations

from vime.config.agents import JudgeConfig
from vime.config.algorithm import AlgorithmConfig
from vime.config.rollout import EnginesConfig
from vime.config.run import JobConfig, PlacementConfig


def placement_of(args, **options):
    """`Placement` of `args`; `options`: with_engines, with_trainers, overlap."""
    from vime.ray.placement import Placement

    return Placement(PlacementConfig.of(args), EnginesConfig.of(args), JudgeConfig.of(args),
                     use_critic=AlgorithmConfig.of(args).use_critic, **options)


def init_ray_of(args) -> None:
    from vime.ray.placement import init_ray

    init_ray(JobConfig.of(args), PlacementConfig.of(args), EnginesConfig.of(args), JudgeConfig.of(args))

