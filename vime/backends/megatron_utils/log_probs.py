"""Log-probs and entropy from vocab-parallel logits (each tensor-parallel rank holds a slice of the vocabulary).

The all-reduces below are Megatron's autograd-aware mappings, so gradients flow correctly with TP > 1; with
TP = 1 they are no-ops and this is plain log_softmax. Temperature is applied first, to match vLLM's
`processed_logprobs` = log_softmax(logits / T).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _vocab_range() -> tuple[int, int]:
    rank = parallel_state.get_tensor_model_parallel_rank()
    return rank, parallel_state.get_tensor_model_parallel_world_size()


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                             with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [..., V/TP] (this rank's vocab slice), targets: [...] full-vocab ids.
    Returns (log p(target) [...], entropy [...] or None)."""
    z = logits.float() / temperature
    tp_rank, tp_size = _vocab_range()
    local_v = z.shape[-1]
    z_max = z.detach().max(dim=-1).values
    if tp_size > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = z - z_max.unsqueeze(-1)
    exp_shifted = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp_shifted.sum(dim=-1))
    log_z = sum_exp.log()  # log partition of the shifted logits

    start = tp_rank * local_v
    local_targets = targets - start
    in_slice = (local_targets >= 0) & (local_targets < local_v)
    picked = shifted.gather(-1, local_targets.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tensor_model_parallel_region(picked * in_slice)
    log_probs = target_logit - log_z

    entropy = None
    if with_entropy:
        # E_p[shifted] = sum(exp(s) * s) / sum(exp(s)): both sums are reduced from purely local terms, so the
        # identity backward of the reduction gives every rank the full gradient. (Normalising by the global log_z
        # before the reduction would leave each rank only its own slice's share of d entropy / d log_z.)
        expected_logit = reduce_from_tensor_model_parallel_region((exp_shifted * shifted).sum(dim=-1)) / sum_exp
        entropy = log_z - expected_logit
    return log_probs, entropy


def response_log_probs(logits: torch.Tensor, tokens: torch.Tensor, total_lengths: list[int],
                       response_lengths: list[int], temperature: float, with_entropy: bool = False):
    """Per-sample log-probs (and entropy) of the response tokens from a padded micro-batch.

    logits: [batch, seq, V/TP] where position t predicts token t+1; tokens: [batch, seq].
    Returns lists of 1-D tensors of length response_lengths[i].
    """
    rows, cols = [], []
    for row, (total, resp) in enumerate(zip(total_lengths, response_lengths)):
        positions = torch.arange(total - resp - 1, total - 1)
        rows.append(torch.full_like(positions, row))
        cols.append(positions)
    rows_t, cols_t = torch.cat(rows), torch.cat(cols)
    picked_logits = logits[rows_t, cols_t]  # [sum of response lengths, V/TP]
    targets = tokens[rows_t, cols_t + 1].to(picked_logits.device)
    lp, ent = vocab_parallel_log_probs(picked_logits, targets, temperature, with_entropy)
    split = list(response_lengths)
    return list(lp.split(split)), (list(ent.split(split)) if ent is not None else None)
