"""Which weights sampled which token, and how stale a trained token is.

An engine whose weights change while a request runs (an update between decode steps, or a partial rollout
continued after one) reports each answer's output tokens as spans `{"version", "start", "end"}` (vLLM's
`WeightVersionSpan`: tokens [start, end) of that answer were sampled by weights labelled `version`). A sample
keeps them over its response tokens as `weight_version_spans`, `[version, start, end]` lists, merged where one
version continues; `weight_versions` (slime's field) keeps the distinct versions in order. Versions are integers
from the engine's answer on (`vime.data.sample.as_version`): 0 for the checkpoint the run started from (vLLM's
"default"), k after the trainer's k-th update.

A token's staleness (lag) is the trainer's weight version minus the version that sampled it: 0 for on-policy
tokens, k when the trainer has taken k updates since.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vime.data.sample import as_version


def add_spans(spans: list[list], versions: list[Any] | None, offset: int, n_tokens: int) -> None:
    """Extend `spans` with one answer's `versions` (vLLM's span dicts, or bare version labels: then the whole
    answer is the last label's) for its `n_tokens` tokens placed at `offset`."""
    if not versions or not n_tokens:
        return
    if all(isinstance(v, dict) for v in versions):
        pieces = [(as_version(v["version"]), offset + int(v["start"]), offset + int(v["end"])) for v in versions]
    else:
        pieces = [(as_version(versions[-1]), offset, offset + n_tokens)]
    for version, start, end in pieces:
        if end <= start:
            continue
        if spans and spans[-1][0] == version and spans[-1][2] == start:
            spans[-1][2] = end
        else:
            spans.append([version, start, end])


def add_versions(distinct: list[int], versions: list[Any] | None) -> None:
    """Append the versions of `versions` (span dicts or labels) to `distinct` where they differ from its last."""
    for v in versions or []:
        version = as_version(v["version"] if isinstance(v, dict) else v)
        if not distinct or distinct[-1] != version:
            distinct.append(version)


def shift_spans(spans: list[list], by: int) -> list[list]:
    """`spans` moved `by` tokens toward the start (from whole-sequence to response positions), cut at 0."""
    shifted = [[v, max(0, s - by), e - by] for v, s, e in spans]
    return [span for span in shifted if span[2] > span[1]]


def trained_tokens_by_version(sample: dict) -> list[list[int]]:
    """[[version, trained (mask 1) response tokens it sampled], ...] of one sample dict, oldest version first: pairs
    of ints, as JSON keeps them (the data transport's summary carries them to the driver). A sample that reports no
    spans counts all its trained tokens under its last version label; [] without any version."""
    n = int(sample.get("response_length") or 0)
    spans = sample.get("weight_version_spans") or []
    if not spans and sample.get("weight_versions"):
        spans = [[sample["weight_versions"][-1], 0, n]]
    mask = sample.get("loss_mask") or [1] * n
    counts: Counter = Counter()
    for version, start, end in spans:  # a slice's sum: this runs over every token of every rollout
        counts[as_version(version)] += sum(mask[max(0, start):min(end, n)])
    return [[v, c] for v, c in sorted(counts.items()) if c]


def staleness_metrics(version_tokens: list[list[list[int]]], trainer_version: int) -> dict[str, float]:
    """Staleness of a batch about to be trained, from each sample's `trained_tokens_by_version`: per sample (its
    oldest token's lag: mean, max), per trained token (mean), the share of trained tokens at each lag
    (`async/token_lag_<k>_fraction`, a histogram per step) and the samples whose tokens span several versions."""
    sample_lags, token_counts = [], Counter()
    for counts in version_tokens:
        lags = {trainer_version - v: c for v, c in counts}
        if lags:
            sample_lags.append(max(lags))
            token_counts.update(lags)
    if not sample_lags:
        return {}
    tokens = sum(token_counts.values())
    metrics = {"async/staleness_mean": sum(sample_lags) / len(sample_lags),
               "async/staleness_max": float(max(sample_lags)),
               "async/token_staleness_mean": sum(k * c for k, c in token_counts.items()) / tokens,
               "async/mixed_version_samples": float(sum(len(c) > 1 for c in version_tokens))}
    for lag, count in sorted(token_counts.items()):
        metrics[f"async/token_lag_{lag}_fraction"] = count / tokens
    return metrics


def oldest_version(sample: dict) -> int | None:
    """The oldest weight version that sampled one of `sample`'s tokens (spans, else its versions); None when it
    reports none."""
    versions = [span[0] for span in sample.get("weight_version_spans") or []] or list(sample.get("weight_versions")
                                                                                      or [])
    return min(as_version(v) for v in versions) if versions else None


def too_stale(sample: dict, trainer_version: int, max_staleness: int | None) -> bool:
    """Whether `sample` has a token sampled more than `max_staleness` versions before `trainer_version` (the
    number of rollouts the trainer has trained: the version label its next update will carry, minus one)."""
    if max_staleness is None:
        return False
    oldest = oldest_version(sample)
    return oldest is not None and trainer_version - oldest > max_staleness
