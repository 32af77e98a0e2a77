"""slime's trainer hooks, by function path, with slime's signatures, called on every training rank:

    --custom-megatron-init-path                     init(args)                      parallel groups up, before the model
    --custom-megatron-before-log-prob-hook-path     hook(args, model, store_prefix) before each log-prob pass:
                                                    "ref_" (KL reference), "teacher_" (distillation), "" (old policy)
    --custom-megatron-before-train-step-hook-path   hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)
    --rollout-data-postprocess-path                 postprocess(args, rollout_id, rollout_data) after the log-probs and
                                                    advantages, before the optimizer steps

`rollout_data` is slime's per-sample dict (`rollout_data_view`): lists indexed by the sample's position in the
rollout; what the hook changes in place, or puts under a key instead, is what the steps train on (`apply_rollout_data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from vime.config.train import TrainLoopConfig
from vime.utils.misc import load_function

# slime's rollout_data key -> the TrainBatch field it is
ROLLOUT_DATA_FIELDS = {
    "tokens": "tokens", "response_lengths": "response_lengths", "loss_masks": "loss_masks", "rewards": "rewards",
    "truncated": "truncated", "rollout_log_probs": "rollout_log_probs", "log_probs": "old_log_probs",
    "ref_log_probs": "ref_log_probs", "teacher_log_probs": "teacher_log_probs", "advantages": "advantages",
    "returns": "returns", "values": "values",
}
# the per-token fields a hook may replace: one value per response token of each sample
PER_TOKEN = ("loss_masks", "advantages", "returns", "log_probs", "ref_log_probs", "rollout_log_probs")


def _load(path: str | None) -> Callable | None:
    return load_function(path) if path else None


@dataclass(frozen=True)
class TrainerHooks:
    init: Callable | None = None
    before_log_prob: Callable | None = None
    before_train_step: Callable | None = None
    postprocess: Callable | None = None

    @classmethod
    def of(cls, train_loop: TrainLoopConfig) -> TrainerHooks:
        return cls(_load(train_loop.custom_megatron_init_path),
                   _load(train_loop.custom_megatron_before_log_prob_hook_path),
                   _load(train_loop.custom_megatron_before_train_step_hook_path),
                   _load(train_loop.rollout_data_postprocess_path))

    def log_prob_pass(self, args, model, store_prefix: str) -> None:
        if self.before_log_prob is not None:
            self.before_log_prob(args, model, store_prefix)


def rollout_data_view(batch) -> dict[str, Any]:
    """slime's rollout_data over `batch`: the same lists (a change in place is a change of the batch); rewards as a
    list of floats."""
    data = {}
    for key, name in ROLLOUT_DATA_FIELDS.items():
        value = getattr(batch, name)
        if value is None or (isinstance(value, list) and not value):
            continue
        data[key] = value.tolist() if isinstance(value, torch.Tensor) else value
    return data


def apply_rollout_data(batch, data: dict[str, Any], path: str) -> None:
    """Take back what the postprocess hook put in `data` (`path`: its flag's value, for errors): per-token lists must
    keep one value per response token of every sample."""
    n = len(batch.tokens)
    for key in PER_TOKEN:
        value = data.get(key)
        if value is None:
            continue
        if len(value) != n:
            raise ValueError(f"--rollout-data-postprocess-path {path}: rollout_data[{key!r}] has {len(value)} "
                             f"samples, the rollout {n}")
        tensors = [None if v is None else torch.as_tensor(v, dtype=torch.float32) for v in value]
        for i, (t, length) in enumerate(zip(tensors, batch.response_lengths)):
            if t is not None and t.numel() != length:
                raise ValueError(f"--rollout-data-postprocess-path {path}: rollout_data[{key!r}][{i}] has "
                                 f"{t.numel()} values for a response of {length} tokens")
        setattr(batch, ROLLOUT_DATA_FIELDS[key], tensors)
    if "rewards" in data:
        batch.rewards = torch.as_tensor(data["rewards"], dtype=torch.float32)
