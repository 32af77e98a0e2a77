"""The MTP layers' loss in a training pass (`vime.trainer.megatron.multi_token_prediction` has the layers): the
decoder's output of each micro-batch feeds the MTP layers, whose logits (through the output layer's weight, read
detached) give each response token's cross-entropy from two positions before it (one more per further layer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from vime.trainer.batching import MicroBatchInputs
from vime.trainer.megatron.multi_token_prediction import mtp_hidden, mtp_layers, mtp_targets


@dataclass
class MTPCrossEntropy:
    """Per MTP layer: the cross-entropy of each response token it predicts, and which of the micro-batch's
    response tokens those are (a mask over them, in order)."""
    ce: list[torch.Tensor] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)

    def token_sum(self, token_weights: torch.Tensor) -> torch.Tensor:
        """Sum over layers and tokens of the cross-entropy weighted by each response token's weight (its loss
        mask), divided by the number of layers."""
        total = sum((ce * token_weights[keep]).sum() for ce, keep in zip(self.ce, self.keep))
        return total / max(len(self.ce), 1)


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
        batch = hidden.shape[1]
        weight = _output_weight(gpt)
        rows_all = inputs.logit_rows.to(hidden.device, non_blocking=True)
        targets_all = inputs.targets.to(hidden.device, non_blocking=True)
        for depth, out in enumerate(mtp_hidden(gpt, hidden, tokens, positions, kwargs), start=1):
            rows, keep = mtp_targets(rows_all, positions, batch, depth)
            picked = out.reshape(-1, out.shape[-1]).index_select(0, rows)
            logits = (picked @ weight.t()).float()  # [R, vocab / TP]: the output layer's, without its hooks
            result.ce.append(vocab_parallel_cross_entropy(logits.unsqueeze(0), targets_all[keep].unsqueeze(0))[0])
            result.keep.append(keep)

    handle = gpt.decoder.register_forward_hook(hook, with_kwargs=True)
    try:
        yield result
    finally:
        handle.remove()
