"""Rollout metrics: pure functions of the samples, plus counters kept in the rollout context.

Counters are things no sample shows: engine restarts (the health monitor), malformed prompt rows (the loader),
the peak number of requests in flight (the generate path). `record_counters(..., once=True)` values are reported
with the next rollout only; the others are running totals reported with every rollout.
"""

from __future__ import annotations

import math

from vime.algorithms.eval_metrics import eval_at_k_metrics
from vime.data.sample import ADAPTER_KEY, Sample
from vime.rollout.context import rollout_context
from vime.rollout.sandbox_runs import sandbox_metrics
from vime.utils.lora_adapters import adapter_names


# --environment runs (vime.environments): the environment a sample came from, and what its reward functions gave
ENVIRONMENT_KEY = "environment"
REWARD_FUNCTIONS_KEY = "reward_functions"  # {function name: value}
REWARD_WEIGHTS_KEY = "reward_weights"  # {function name: weight in the reward}


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs):
    """Population std in floats (statistics.pstdev works in exact fractions: slow, and it crashes on NaN)."""
    mean = _mean(xs)
    return math.sqrt(_mean([(x - mean) ** 2 for x in xs]))


def _reward_values(samples: list[Sample], args) -> tuple[list[float], int]:
    """The finite rewards of the scored samples, and how many were not finite. The default rollout fails a sample
    with a NaN or inf reward; a custom rollout function may hand one over as scored."""
    values = [s.get_reward_value(args) for s in samples
              if s.status not in (Sample.Status.FAILED, Sample.Status.ABORTED) and s.reward is not None]
    finite = [v for v in values if math.isfinite(v)]
    return finite, len(values) - len(finite)


def record_counters(values: dict[str, float], once: bool = True) -> None:
    """Set counters reported with the next rollout's metrics (`once`) or with every rollout from now on."""
    context = rollout_context()
    with context.lock:
        (context.counters_once if once else context.counters).update(values)


def add_counter(key: str, n: float = 1.0) -> None:
    """Add `n` to a running total (e.g. rollout/engine_restarts)."""
    rollout_context().add_counter(key, n)


def take_counters() -> dict[str, float]:
    """The counters to report now: the running totals and the once-only values (which are then cleared)."""
    context = rollout_context()
    with context.lock:
        out = {**context.counters, **context.counters_once}
        context.counters_once.clear()
    return out


def failure_key(sample: Sample) -> str:
    """`<stage>_<reason>` of a failed sample, e.g. reward_timeout, generate_engine_rejected."""
    failure = sample.metadata.get("failure") or {}
    return f"{failure.get('stage', 'unknown')}_{failure.get('reason', 'error')}"


def rollout_metrics(samples: list[Sample], args=None, prefix: str = "rollout") -> dict[str, float]:
    """Reward, length, truncation and failure statistics of one rollout's samples (failures by stage and reason:
    `<prefix>/failed/<stage>_<reason>`); a training rollout (prefix "rollout") also reports the counters and, in a
    multi-LoRA run, the same statistics of each adapter's samples (`rollout/adapter/<name>/reward_mean`, ...; an
    eval set is one adapter's already). Reward statistics cover the scored samples' finite rewards;
    `<prefix>/non_finite_rewards` counts the others. Sandboxed runs (tool calls, gradings) and the sandbox's own
    failures among them: `<prefix>/sandbox/...` (sandbox_runs.py)."""
    rewards, non_finite = _reward_values(samples, args)
    lengths = [s.response_length for s in samples]
    m = {
        f"{prefix}/num_samples": float(len(samples)),
        f"{prefix}/reward_mean": _mean(rewards),
        f"{prefix}/reward_std": _std(rewards),
        f"{prefix}/response_len_mean": _mean(lengths),
        f"{prefix}/response_len_max": float(max(lengths, default=0)),
        f"{prefix}/truncated_ratio": _mean([float(s.status == Sample.Status.TRUNCATED) for s in samples]),
        f"{prefix}/failed_samples": float(sum(s.status == Sample.Status.FAILED for s in samples)),
        f"{prefix}/response_tokens": float(sum(lengths)),
    }
    if non_finite:
        m[f"{prefix}/non_finite_rewards"] = float(non_finite)
    for s in samples:
        if s.status == Sample.Status.FAILED:
            key = f"{prefix}/failed/{failure_key(s)}"
            m[key] = m.get(key, 0.0) + 1.0
    m.update(environment_metrics(samples, args, prefix))
    m.update(sandbox_metrics(samples, prefix))
    if prefix == "rollout" and args is not None:
        m.update(take_counters())
        for name in adapter_names(args):
            mine = [s for s in samples if s.metadata.get(ADAPTER_KEY) == name]
            m.update(rollout_metrics(mine, args, prefix=f"{prefix}/adapter/{name}"))
    return m


def environment_metrics(samples: list[Sample], args, prefix: str) -> dict[str, float]:
    """Per environment of an --environment run (`<prefix>/env/<name>/...`): its samples' count, reward mean and
    failures, and each reward function's mean value and weight (`fn/<function>_mean`, `fn/<function>_weight`,
    over the samples that report it). An environment's own eval set (`eval/<name>`) already is that environment's
    statistics: only its functions' (`eval/<name>/fn/...`). Empty when no sample is tagged with an environment."""
    by_env: dict[str, list[Sample]] = {}
    for s in samples:
        name = s.metadata.get(ENVIRONMENT_KEY)
        if name is not None:
            by_env.setdefault(str(name), []).append(s)
    m = {}
    for name, mine in sorted(by_env.items()):
        if len(by_env) == 1 and prefix.endswith(f"/{name}"):  # an environment's own eval set: no repeats
            base = prefix
        else:
            rewards, _ = _reward_values(mine, args)
            base = f"{prefix}/env/{name}"
            m[f"{base}/num_samples"] = float(len(mine))
            m[f"{base}/reward_mean"] = _mean(rewards)
            m[f"{base}/failed_samples"] = float(sum(s.status == Sample.Status.FAILED for s in mine))
        values: dict[str, list[float]] = {}
        weights: dict[str, float] = {}
        for s in mine:
            for fn, value in (s.metadata.get(REWARD_FUNCTIONS_KEY) or {}).items():
                values.setdefault(fn, []).append(float(value))
            weights.update(s.metadata.get(REWARD_WEIGHTS_KEY) or {})
        for fn, vs in sorted(values.items()):
            m[f"{base}/fn/{fn}_mean"] = _mean(vs)
            if fn in weights:
                m[f"{base}/fn/{fn}_weight"] = float(weights[fn])
    return m


def eval_answer(sample: Sample) -> str:
    """What maj@k votes on: `metadata["eval_answer"]` when the reward function set one (an extracted final
    answer), else the response text without surrounding whitespace."""
    return str(sample.metadata.get("eval_answer", sample.response.strip()))


def eval_at_k(samples: list[Sample], args, ks: list[int], prefix: str) -> dict[str, float]:
    """`<prefix>/pass@k`, `mean@k`, `maj@k` of an eval set's samples, n per prompt (consecutive samples of one
    group_index, in the order generated); a failed or unscored sample counts as reward 0 (incorrect)."""
    prompts: list[tuple[list[str], list[float]]] = []
    last = object()
    for s in samples:
        scored = s.status not in (Sample.Status.FAILED, Sample.Status.ABORTED) and s.reward is not None
        reward = s.get_reward_value(args) if scored else 0.0
        if s.group_index != last:
            prompts.append(([], []))
            last = s.group_index
        prompts[-1][0].append(eval_answer(s))
        prompts[-1][1].append(reward if math.isfinite(reward) else 0.0)
    return {f"{prefix}/{k}": v for k, v in eval_at_k_metrics(prompts, ks).items()}
