"""The reward worker processes: rewards that can hang run here, where a call past `--rm-timeout` is killed.

One `WorkerPool` (see `vime.rollout.worker_pool`) per run, held by its rollout context, made on first use from
`--rm-num-workers` and `--rm-worker-memory-mb`; each worker it kills and replaces adds one to
`rollout/reward_workers_replaced`. Users: `math_rm` (sympy can hang on adversarial answers) and `--custom-rm-path`
with `--custom-rm-in-workers`, whose function gets `args` as a Namespace of the JSON-able flags and a
`Sample.from_dict` copy of the sample (so changes it makes to the sample are not seen by the rollout), and must
return JSON-able values.
"""

from __future__ import annotations

import json
from typing import Any

from vime.config.rollout import RewardConfig
from vime.data.sample import Sample
from vime.rollout.context import rollout_context
from vime.rollout.worker_pool import CALL_WITH_SAMPLE, WorkerPool
from vime.utils.cpus import allowed_cpus

REPLACED_COUNTER = "rollout/reward_workers_replaced"


def default_num_workers() -> int:
    return min(4, len(allowed_cpus()))


def reward_pool(args) -> WorkerPool:
    """The run's reward pool (its rollout context holds it), started on first use."""
    rewards = RewardConfig.of(args)
    context = rollout_context()
    with context.lock:
        if context.reward_workers is None:
            size = rewards.rm_num_workers
            size = default_num_workers() if size is None else size
            memory_mb = rewards.rm_worker_memory_mb or 0
            if size < 1 or memory_mb < 0:
                raise ValueError(f"--rm-num-workers {size} must be >= 1 and --rm-worker-memory-mb {memory_mb} >= 0")
            # a replaced worker is counted from the pool's own threads: the context is bound here, not looked up
            context.reward_workers = WorkerPool(size, memory_mb=memory_mb or None, preload=_preload(args),
                                                on_replace=lambda: context.add_counter(REPLACED_COUNTER),
                                                name="vime-reward")
        return context.reward_workers


def _preload(args) -> tuple[str, ...]:
    """What a worker imports as it starts, so that a replaced worker is soon ready: the pooled custom function's
    module, else math_verify (a second or more under load)."""
    rewards = RewardConfig.of(args)
    custom_path = rewards.custom_rm_path
    if custom_path and rewards.custom_rm_in_workers:
        return (custom_path.replace(":", ".").rpartition(".")[0],)
    return (f"{__package__}.math_rm",)


def close_reward_pool() -> None:
    """Kill the run's reward workers (between tests; the rollout manager's shutdown closes its context); the next
    reward starts a new pool."""
    context = rollout_context()
    with context.lock:
        pool, context.reward_workers = context.reward_workers, None
    if pool is not None:
        pool.close()


def reward_timeout(args) -> float:
    return RewardConfig.of(args).rm_timeout or RewardConfig().rm_timeout  # an explicit None: the flag's default


def _jsonable_args(args) -> dict[str, Any]:
    """The flags a worker can receive; others (objects a custom launcher hung on args) stay behind."""
    out = {}
    for key, value in vars(args).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


async def pooled_reward(args, fn_path: str, samples: Sample | list[Sample], **kwargs: Any) -> Any:
    """`fn(args, samples, **kwargs)` for `--custom-rm-path fn` in a reward worker, within --rm-timeout."""
    payload = [s.to_dict() for s in samples] if isinstance(samples, list) else samples.to_dict()
    try:
        return await reward_pool(args).acall(CALL_WITH_SAMPLE, fn_path, _jsonable_args(args), payload, kwargs,
                                             timeout=reward_timeout(args))
    except TypeError as e:  # raised before the call: something in the sample or kwargs is not JSON
        raise TypeError(f"--custom-rm-in-workers sends the sample(s) and keyword arguments of {fn_path} to a worker "
                        f"as JSON: {e}; keep sample.metadata JSON-able or drop --custom-rm-in-workers") from None
