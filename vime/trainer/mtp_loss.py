"""The MTP layers' loss in a training pass (`vime.trainer.megatron.multi_token_prediction` has the layers): the
decoder's output of each micro-batch feeds the MTP layers, whose logits (through the output layer's weight, read
detached) give each response token's cross-entropy from two positions before it (one more per further layer),
computed as the policy's log-probs are (`log_probs.vocab_parallel_log_probs`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

from vime.trainer.batching import MicroBatchInputs
from vime.trainer.log_probs import vocab_parallel_log_probs
from vime.trainer.megatron.multi_token_prediction import mtp_hidden, mtp_layers, mtp_targets


@dataclass
class MTPCrossEntropy:
    """Per MTP layer, each response token's cross-entropy in the micro-batch's order; 0 for a token the layer
    cannot predict (fewer than `depth` positions of its sequence before its next-token row)."""
    ce: list[torch.Tensor] = field(default_factory=list)

    def token_sum(self, token_weights: torch.Tensor) -> torch.Tensor:
        """Sum over tokens of the cross-entropy weighted by each response token's weight (its loss mask), the
        mean over layers."""
        return sum((ce * token_weights).sum() for ce in self.ce) / max(len(self.ce), 1)


def _output_weight(gpt) -> torch.Tensor:
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight().detach()
    return gpt.output_layer.weight.detach()


@contextlib.contextmanager
def mtp_cross_entropy(gpt, inputs: MicroBatchInputs, tokens: torch.Tensor, positions: torch.Tensor):
    """Within the block, a forward of `gpt` (a GPTModel with MTP layers, on the last stage) fills the yielded
    `MTPCrossEntropy`; yields None where the model holds no MTP layers."""
    if not mtp_layers(gpt):
        yield None
        return
    result = MTPCrossEntropy()

    def hook(module, args, kwargs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        weight = _output_weight(gpt)
        logit_rows = inputs.logit_rows.to(hidden.device, non_blocking=True)
        targets = inputs.targets.to(hidden.device, non_blocking=True)
        for depth, out in enumerate(mtp_hidden(gpt, hidden, tokens, positions, kwargs), start=1):
            rows, valid = mtp_targets(logit_rows, positions, hidden.shape[1], depth)
            # each TP rank holds a vocabulary shard of the weight: the rows' gradient is the sum over the shards
            # (the all-reduce backward of Megatron's ColumnParallelLinear input, identity forward)
            rows_hidden = copy_to_tensor_model_parallel_region(out.reshape(-1, out.shape[-1]).index_select(0, rows))
            logits = rows_hidden @ weight.t()  # [R, vocab / TP]
            log_probs, _ = vocab_parallel_log_probs(logits, targets)
            result.ce.append(-log_probs * valid.to(log_probs.dtype))

    handle = gpt.decoder.register_forward_hook(hook, with_kwargs=True)
    try:
        yield result
    finally:
        handle.remove()
