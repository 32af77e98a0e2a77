"""slime's `--custom-convert-samples-to-train-data-path`: `convert(args, samples) -> dict` of per-sample lists in
place of the default conversion, folded back into the samples vime hands to the trainer.

    apply_train_data(samples, convert(args, samples), path)

The keys vime trains on: `tokens`, `response_lengths`, `loss_masks`, `rewards` (what the advantage estimator starts
from; vime's estimators normalise per group themselves), `rollout_log_probs`, `truncated`. slime's bookkeeping keys
(`raw_reward`, `sample_indices`, `rollout_ids`, `rollout_mask_sums`, `round_number`) are accepted and kept in each
sample's metadata under "train_data"; any other key is an error naming it (the trainer would never see it).
"""

from __future__ import annotations

from typing import Any

from vime.data.sample import Sample

APPLIED = ("tokens", "response_lengths", "loss_masks", "rewards", "rollout_log_probs", "truncated")
KEPT = ("raw_reward", "sample_indices", "rollout_ids", "rollout_mask_sums", "round_number")


def apply_train_data(samples: list[Sample], train_data: Any, path: str) -> None:
    """Set each sample's fields from `train_data` (the converter's output for `samples`, in their order)."""
    where = f"--custom-convert-samples-to-train-data-path {path}"
    if not isinstance(train_data, dict):
        raise TypeError(f"{where} must return a dict of per-sample lists, got {type(train_data).__name__}")
    unknown = sorted(set(train_data) - set(APPLIED) - set(KEPT))
    if unknown:
        raise ValueError(f"{where} returned keys vime does not train on: {', '.join(unknown)} (it trains on "
                         f"{', '.join(APPLIED)}; keeps {', '.join(KEPT)} in metadata['train_data'])")
    for key, values in train_data.items():
        if not isinstance(values, (list, tuple)) or len(values) != len(samples):
            raise ValueError(f"{where}: {key!r} must be a list of one entry per sample ({len(samples)}), got "
                             f"{type(values).__name__} of {len(values) if hasattr(values, '__len__') else '?'}")
    for i, sample in enumerate(samples):
        row = {key: values[i] for key, values in train_data.items()}
        if "tokens" in row:
            sample.tokens = list(row["tokens"])
        if "response_lengths" in row:
            sample.response_length = int(row["response_lengths"])
        if "loss_masks" in row:
            sample.loss_mask = [int(m) for m in row["loss_masks"]]
        if "rewards" in row:
            sample.reward = float(row["rewards"])
        if "rollout_log_probs" in row:
            sample.rollout_log_probs = None if row["rollout_log_probs"] is None else [
                float(x) for x in row["rollout_log_probs"]]
        if "truncated" in row and sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
            sample.status = Sample.Status.TRUNCATED if row["truncated"] else Sample.Status.COMPLETED
        kept = {key: row[key] for key in KEPT if key in row}
        if kept:
            sample.metadata["train_data"] = kept
        if sample.loss_mask is not None and len(sample.loss_mask) != sample.response_length:
            raise ValueError(f"{where}: sample {i} has {len(sample.loss_mask)} loss-mask entries for a response of "
                             f"{sample.response_length} tokens")
