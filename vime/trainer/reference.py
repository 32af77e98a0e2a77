"""Where the actor's first weights and the KL reference come from (slime's `--ref-load`, `--ref-update-interval`).

    start = starting_weights(model, megatron, needs_reference)   # after the model is built from --hf-checkpoint
    start.reference                                            # the reference's weights, when --ref-load gives it

slime's rules: `--ref-load` (a torch_dist checkpoint, or here also an HF directory) is the KL reference; when
`--load` holds no checkpoint the actor starts from it too (a resume from `--load` keeps the reference). Without
`--ref-load` the reference is the actor's first weights, as before. `refresh_due` says when `--ref-update-interval`
replaces the reference with the actor's current weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from vime.config.train import MegatronConfig
from vime.trainer.megatron.checkpoint import load_model_weights
from vime.trainer.megatron.checkpoint_files import resolve_checkpoint
from vime.trainer.weight_snapshots import restore, snapshot

logger = logging.getLogger(__name__)


@dataclass
class StartingWeights:
    reference: list[dict[str, torch.Tensor]] | None  # --ref-load's weights, in this rank's layout
    from_reference: bool  # the actor starts from them (--load holds no checkpoint)


def has_checkpoint(root: str | None) -> bool:
    return bool(root) and Path(root).is_dir() and resolve_checkpoint(root) is not None


def checkpoint_weights(model, path: str) -> list[dict[str, torch.Tensor]]:
    """The weights of `path` (an HF directory, or a torch_dist one) in this rank's layout: loaded into the model,
    copied, and the model's own weights put back. Collective."""
    from vime.trainer.megatron.hf_checkpoint import load_hf_checkpoint_into_model

    own = snapshot(model)
    try:
        if (Path(path) / "config.json").is_file():
            load_hf_checkpoint_into_model(model, path)
        else:
            load_model_weights(model, path)
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"--ref-load {path}: its weights do not fit the model built from --hf-checkpoint "
                         f"(the reference must have the actor's architecture): {e}") from e
    loaded = snapshot(model)
    restore(model, own)
    return loaded


def starting_weights(model, optimizer, megatron: MegatronConfig, needs_reference: bool) -> StartingWeights:
    """Load --ref-load where it is the reference or the actor's start, and start the actor from it when --load holds
    no checkpoint (its optimizer's copies of the weights follow). Collective."""
    if not megatron.ref_load:
        return StartingWeights(None, False)
    from_reference = not has_checkpoint(megatron.load)
    if not (needs_reference or from_reference):
        return StartingWeights(None, False)
    weights = checkpoint_weights(model, megatron.ref_load)
    if from_reference:
        restore(model, weights)
        optimizer.reload_model_params()  # the fp32 main copies (distributed optimizer, bf16) follow
        logger.info("the actor starts from --ref-load %s (--load %s holds no checkpoint)", megatron.ref_load,
                    megatron.load)
    return StartingWeights(weights if needs_reference else None, from_reference)


def reference_state(model, optimizer, megatron: MegatronConfig, needs_reference: bool,
                    adapters_only: bool) -> list[dict[str, torch.Tensor]] | None:
    """The actor's KL reference (None when no KL needs one): --ref-load's weights, else the starting weights (with
    LoRA the starting adapters alone: the base is frozen). Starts the actor from --ref-load when --load holds no
    checkpoint (`starting_weights`). Collective."""
    start = starting_weights(model, optimizer, megatron, needs_reference)
    if not needs_reference:
        return None
    return start.reference or snapshot(model, adapters_only=adapters_only)


def refresh_due(rollout_id: int, interval: int | None) -> bool:
    """Whether the reference becomes the actor's weights after training rollout `rollout_id`
    (--ref-update-interval: after every `interval` rollouts, counted from 1)."""
    return interval is not None and (rollout_id + 1) % interval == 0
