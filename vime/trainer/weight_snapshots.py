"""Copies of a rank's weights that it swaps in for one forward pass and then puts back: the KL reference (the
starting weights; with LoRA only the starting adapters, the base being frozen) and the on-policy distillation
teacher (its checkpoint loaded into this rank's layout once). One model in memory, one state dict per copy.
"""

from __future__ import annotations

import torch

from vime.trainer.megatron.lora import is_lora_parameter
from vime.trainer.passes import forward_log_probs
from vime.trainer.train_batch import TrainBatch


def snapshot(model, adapters_only: bool = False) -> list[dict[str, torch.Tensor]]:
    """A copy of each chunk's state (`adapters_only`: its LoRA adapters); `restore` puts back what it holds."""
    return [{k: v.detach().clone() for k, v in m.module.state_dict().items()
             if v is not None and (not adapters_only or is_lora_parameter(k))} for m in model]


def restore(model, state: list[dict[str, torch.Tensor]]) -> None:
    with torch.no_grad():
        for m, sd in zip(model, state):
            own = m.module.state_dict()
            for k, v in sd.items():
                own[k].copy_(v)


def teacher_snapshot(model, checkpoint: str) -> list[dict[str, torch.Tensor]]:
    """The distillation teacher's weights in this rank's layout: loaded into the model, copied, swapped out."""
    from vime.trainer.megatron.hf_checkpoint import load_hf_checkpoint_into_model

    own = snapshot(model)
    try:
        load_hf_checkpoint_into_model(model, checkpoint)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"--opd-teacher-checkpoint {checkpoint}: the teacher runs in the trainer and must have the "
                         f"student's architecture ({e})") from e
    teacher = snapshot(model)
    restore(model, own)
    return teacher


def log_probs_under(args, model, states: dict, batch: TrainBatch, mbs: list, routing, phase,
                    adapters_only: bool, before=None) -> dict:
    """{name: log-probs of `batch`} under each of `states` ({name: weights}: reference, teacher), the policy's
    own weights put back after each. A state may hold only part of the model (a LoRA reference: the adapters;
    a teacher is whole): it is laid over the policy's own weights, never over another state's. `adapters_only`:
    every state holds adapters only, so only the policy's adapters need keeping. `before(name)` runs with the
    state's weights in place, before its pass (slime's before-log-prob hook)."""
    if not states:
        return {}
    current = snapshot(model, adapters_only=adapters_only)
    out = {}
    for name, state in states.items():
        restore(model, state)
        if before is not None:
            before(name)
        with phase(name):
            out[name] = dense(forward_log_probs(args, model, batch, mbs, routing=routing), len(batch.tokens))
        restore(model, current)
    return out


def dense(by_index: dict, n: int) -> list:
    """{sample index: (log-probs, entropy)} -> the log-probs of every sample, None where not computed."""
    return [by_index[i][0] if i in by_index else None for i in range(n)]
