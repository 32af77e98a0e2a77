"""Reward functions: score a finished `Sample` (who calls: the rollout, after generation).

`--custom-rm-path pkg.mod.fn` wins when set: `fn(args, sample) -> float | dict`, sync or async; with
`--group-rm` it is instead called once per group, `fn(args, samples) -> list`. Otherwise `--rm-type`
names a function in `RM_REGISTRY` (see `registry.py`; one module per type beside this file).

A sync custom function runs in a worker thread, so that `--rm-timeout` holds even when it blocks (the thread
cannot be interrupted: it finishes in the background). An async one must not block the event loop. With
`--custom-rm-in-workers` the function (sync or async) runs in a reward worker process instead (`pool.py`), killed
at `--rm-timeout`: for functions that can hang or eat memory.
A custom function that returns something else than a number or a dict raises `RewardTypeError`.

In a multi-LoRA run (--lora-adapters NAME=PROMPT_DATA:RM) a sample of an adapter with its own RM is scored by it
instead: an --rm-type name, or a function path with --custom-rm-path's contract (--custom-rm-in-workers too).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import numbers
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vime.config.rollout import RewardConfig
from vime.config.train import LoraConfig
from vime.data.sample import ADAPTER_KEY, Sample
from vime.utils.lora_adapters import parse_adapter_spec
from vime.utils.misc import load_function

from . import boxed, dapo, exact_match, f1, gpqa, math_rm, random_rm, remote_rm  # noqa: F401  (fill the registry)
from .pool import pooled_reward
from .registry import RM_REGISTRY, register_rm

__all__ = ["RM_REGISTRY", "RewardTypeError", "async_rm", "batched_async_rm", "register_rm"]

class RewardTypeError(TypeError):
    """A custom reward function returned something other than a number or a dict."""


class RewardThreadsExhaustedError(RuntimeError):
    """Every reward thread is held by a call that has not returned (hung past --rm-timeout)."""


class RewardThreads:
    """The threads sync custom rewards run in, and how many are held. A thread cannot be stopped: a call hung past
    --rm-timeout keeps its thread until it returns. Once all `limit` are held, `submit` refuses at once (a recorded
    per-sample failure) instead of queueing the call behind them forever."""

    def __init__(self, limit: int = 128):  # enough that a few hanging calls do not starve the others
        self.limit, self.busy = limit, 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="vime-reward")

    def submit(self, fn, *args, **kwargs) -> asyncio.Future:
        with self._lock:
            if self.busy >= self.limit:
                raise RewardThreadsExhaustedError(
                    f"all {self.limit} reward threads are held by calls of {getattr(fn, '__name__', fn)} that have "
                    "not returned (past --rm-timeout); run it with --custom-rm-in-workers, where a call is killed "
                    "at the timeout")
            self.busy += 1
        # in the caller's context variables, as asyncio.to_thread does: the function may read the rollout context
        future = self._executor.submit(contextvars.copy_context().run, functools.partial(fn, *args, **kwargs))
        future.add_done_callback(self._release)
        return asyncio.wrap_future(future)

    def _release(self, _) -> None:
        with self._lock:
            self.busy -= 1


@functools.cache
def reward_threads() -> RewardThreads:
    """This process's reward threads (made on first use)."""
    return RewardThreads()


async def _call(fn, *args: Any, in_thread: bool = False, **kwargs: Any) -> Any:
    if in_thread and not inspect.iscoroutinefunction(fn):
        result = await reward_threads().submit(fn, *args, **kwargs)
    else:
        result = fn(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def check_reward(value: Any, path: str, flag: str = "--custom-rm-path") -> float | dict:
    if isinstance(value, dict) or (isinstance(value, numbers.Real) and not isinstance(value, bool)):
        return value
    raise RewardTypeError(f"{flag} {path} returned {type(value).__name__} ({value!r:.200}), expected a float or a "
                          "dict")


@functools.cache
def _adapter_rms(entries: tuple[str, ...]) -> dict[str, str]:
    return {spec.name: spec.rm for spec in map(parse_adapter_spec, entries) if spec.rm}


def sample_reward(args, sample: Sample) -> tuple[str | None, str | None, str]:
    """(custom function path, --rm-type name, the flag that chose them) scoring `sample`: its adapter's own RM in a
    multi-LoRA run (a registry name, else a function path), else --custom-rm-path, else --rm-type."""
    lora = LoraConfig.of(args)
    rewards = RewardConfig.of(args)
    adapter = sample.metadata.get(ADAPTER_KEY)
    rm = _adapter_rms(tuple(lora.lora_adapters or ())).get(adapter) if adapter else None
    if rm is not None:
        flag = f"--lora-adapters {adapter} RM"
        return (None, rm, flag) if rm in RM_REGISTRY else (rm, None, flag)
    custom_path = rewards.custom_rm_path
    if custom_path:
        return custom_path, None, "--custom-rm-path"
    return None, rewards.rm_type, "--rm-type"


async def async_rm(args, sample: Sample, **kwargs: Any) -> float | dict:
    """The reward of one sample (by `sample_reward`'s choice). `kwargs` are passed to a custom function only."""
    rewards = RewardConfig.of(args)
    custom_path, rm_type, flag = sample_reward(args, sample)
    if custom_path:
        if rewards.custom_rm_in_workers:
            return check_reward(await pooled_reward(args, custom_path, sample, **kwargs), custom_path, flag)
        return check_reward(await _call(load_function(custom_path), args, sample, in_thread=True, **kwargs),
                            custom_path, flag)
    fn = RM_REGISTRY.get(rm_type)
    if fn is None:
        raise ValueError(f"unknown --rm-type {rm_type!r}; known types: {sorted(RM_REGISTRY)}")
    if fn.needs_label and sample.label is None:
        raise ValueError(f"sample {sample.index}: label is None, but {flag} {rm_type!r} needs one")
    return await _call(fn, args, sample)


async def batched_async_rm(args, samples: list[Sample]) -> list[float | dict]:
    """Rewards for `samples`, in order. Does not write `sample.reward`."""
    rewards_flags = RewardConfig.of(args)
    custom_path = rewards_flags.custom_rm_path
    if rewards_flags.group_rm and custom_path:
        if rewards_flags.custom_rm_in_workers:
            rewards = await pooled_reward(args, custom_path, samples)
        else:
            rewards = await _call(load_function(custom_path), args, samples, in_thread=True)
        if not isinstance(rewards, (list, tuple)):
            raise RewardTypeError(f"group reward function {custom_path!r} returned {type(rewards).__name__} "
                                  f"({rewards!r:.200}), expected a list of {len(samples)} rewards")
        if len(rewards) != len(samples):
            raise ValueError(f"group reward function {custom_path!r} returned {len(rewards)} rewards for "
                             f"{len(samples)} samples")
        return [check_reward(r, custom_path) for r in rewards]
    return list(await asyncio.gather(*(async_rm(args, sample) for sample in samples)))
