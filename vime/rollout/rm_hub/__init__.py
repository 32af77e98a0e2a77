"""Reward functions: score a finished `Sample` (who calls: the rollout, after generation).

`--custom-rm-path pkg.mod.fn` wins when set: `fn(args, sample) -> float | dict`, sync or async; with
`--group-rm` it is instead called once per group, `fn(args, samples) -> list`. Otherwise `--rm-type`
names a function in `RM_REGISTRY` (see `registry.py`; one module per type beside this file).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from vime.utils.misc import load_function
from vime.utils.types import Sample

from . import boxed, dapo, exact_match, f1, gpqa, math_rm, random_rm, remote_rm  # noqa: F401  (fill the registry)
from .registry import RM_REGISTRY, register_rm

__all__ = ["RM_REGISTRY", "async_rm", "batched_async_rm", "register_rm"]


async def _call(fn, *args: Any, **kwargs: Any) -> Any:
    result = fn(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def async_rm(args, sample: Sample, **kwargs: Any) -> float | dict:
    """The reward of one sample. `kwargs` are passed to a custom function only."""
    custom_path = getattr(args, "custom_rm_path", None)
    if custom_path:
        return await _call(load_function(custom_path), args, sample, **kwargs)
    rm_type = getattr(args, "rm_type", None)
    fn = RM_REGISTRY.get(rm_type)
    if fn is None:
        raise ValueError(f"unknown --rm-type {rm_type!r}; known types: {sorted(RM_REGISTRY)}")
    if fn.needs_label and sample.label is None:
        raise ValueError(f"sample {sample.index}: label is None, but --rm-type {rm_type!r} needs one")
    return await _call(fn, args, sample)


async def batched_async_rm(args, samples: list[Sample]) -> list[float | dict]:
    """Rewards for `samples`, in order. Does not write `sample.reward`."""
    custom_path = getattr(args, "custom_rm_path", None)
    if getattr(args, "group_rm", False) and custom_path:
        rewards = await _call(load_function(custom_path), args, samples)
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            got = len(rewards) if isinstance(rewards, (list, tuple)) else type(rewards).__name__
            raise ValueError(f"group reward function {custom_path!r} returned {got} rewards for {len(samples)} samples")
        return list(rewards)
    return list(await asyncio.gather(*(async_rm(args, sample) for sample in samples)))
