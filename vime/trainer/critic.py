"""The PPO critic: the policy's transformer with a one-output value head instead of the LM head.

The value of response token t is read at the same position as its log-prob (the state before the token),
so values, log-probs and advantages line up token for token.
"""

from __future__ import annotations

import torch

from vime.algorithms import aggregate_loss, value_loss
from vime.config.algorithm import AlgorithmConfig
from vime.trainer.train_batch import TrainBatch


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer: hidden [s, b, h] -> values [s, b, 1]. Zero-initialised, so the
    first values are 0. Replicated on tensor-parallel ranks (its input is replicated there too)."""

    def __init__(self, hidden_size: int, device=None, dtype=None):
        super().__init__()
        # named `weight` so checkpoints keep Megatron's `output_layer.weight` key
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, device=device, dtype=dtype))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight), None


def attach_value_head(chunks) -> None:
    """Replace the LM head of the last pipeline stage's chunk with a value head (before DDP wrapping), on the
    chunk's device and in its parameters' dtype: the chunk is already where it trains (`build_model_chunks`)."""
    for chunk in chunks:
        if getattr(chunk, "post_process", False):
            like = next(chunk.parameters())
            chunk.output_layer = ValueHead(chunk.config.hidden_size, device=like.device, dtype=like.dtype)
            chunk.share_embeddings_and_output_weights = False
            if hasattr(chunk, "mtp"):  # a critic drafts no tokens: no MTP layers (--mtp-num-layers is the actor's)
                del chunk.mtp


def make_value_loss_fn(args, batch: TrainBatch, denominators: dict, scale: float):
    """Clipped value loss against the returns computed by the actor (GAE), as a share of the global mean."""

    algorithm = AlgorithmConfig.of(args)
    def loss_fn(indices, inputs, output):
        values = list(output[:, 0].float().split(inputs.response_lengths))  # [R, 1]: one row per response token
        mb = batch.select(indices, output.device)  # the batch's CPU tensors, on the model's device once
        masks = mb["loss_masks"]
        losses, clipped = zip(*(value_loss(v, old, ret, algorithm.value_clip)
                                for v, old, ret in zip(values, mb["old_values"], mb["returns"])))

        def agg(xs):
            return aggregate_loss(list(xs), masks, algorithm.loss_agg_mode, total_tokens=denominators["tokens"],
                                  num_sequences=denominators["sequences"])

        loss = agg(losses)
        metrics = {"value_loss": loss.detach(), "value_clipfrac": agg(clipped).detach(),
                   "values_mean": agg([v.detach() for v in values])}
        return loss * scale, metrics

    return loss_fn
