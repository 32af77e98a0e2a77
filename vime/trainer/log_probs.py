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
                             with_entropy: bool = False, entropy_grad: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [..., V/TP] (this rank's vocab slice), targets: [...] full-vocab ids.
    Returns (log p(target) [...], entropy [...] or None). `entropy_grad=False`: the entropy is only reported,
    so it is computed without keeping a graph (a [tokens x vocab] product less to store and differentiate)."""
    tp_rank, tp_size = _vocab_range()
    if tp_size == 1 and (logits.dtype != torch.float32 or logits.numel() >= CHUNKED_FROM_ELEMENTS):
        # 16-bit or large logits: row chunks in float32, nothing of [tokens x vocab] kept but the logits themselves
        rows = max(1, CHUNK_ELEMENTS // max(logits.shape[-1], 1))
        return _ChunkedTargetLogProbs.apply(logits, targets, temperature, with_entropy, entropy_grad, rows)
    z = logits.float() / temperature if temperature != 1.0 else logits.float()
    if tp_size == 1:  # the whole vocabulary on this rank: one fused function, few passes over [tokens x vocab]
        log_probs, entropy = _TargetLogProbs.apply(z, targets, with_entropy, entropy_grad)
        return log_probs, entropy
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
    if with_entropy and not entropy_grad:
        with torch.no_grad():
            entropy = _entropy(exp_shifted, shifted, sum_exp, log_z)
    elif with_entropy:
        # E_p[shifted] = sum(exp(s) * s) / sum(exp(s)): both sums are reduced from purely local terms, so the
        # identity backward of the reduction gives every rank the full gradient. (Normalising by the global log_z
        # before the reduction would leave each rank only its own slice's share of d entropy / d log_z.)
        entropy = _entropy(exp_shifted, shifted, sum_exp, log_z)
    return log_probs, entropy


class _TargetLogProbs(torch.autograd.Function):
    """log softmax(z)[target] and the entropy of softmax(z), rows of z being [N, V] full-vocabulary logits.

    One [N, V] buffer serves the whole pass: torch's fused log_softmax writes it, the targets' log-probs are read
    from it, then it becomes the softmax p in place, which the entropy (H = log Z - E_p[z], one dot product per
    row) and the backward (d log p_t / dz = onehot_t - p; d H / dz = p * (E_p[z] - z)) reuse. The backward turns
    it into the gradient in place, so it runs once (autograd refuses a second run: the buffer has changed).
    On CPU every fresh [N, V] buffer costs page faults, more than the log-softmax itself."""

    @staticmethod
    def forward(ctx, z, targets, with_entropy: bool, entropy_grad: bool):
        p = torch.log_softmax(z, dim=-1)
        log_probs = p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        log_z = z[:, 0] - p[:, 0] if z.shape[0] else z.new_zeros(0)  # log_softmax = z - log Z, in any column
        p.exp_()
        entropy = expected = None
        if with_entropy:
            expected = torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
            entropy = log_z - expected
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(p, targets, *((z, expected) if ctx.entropy_grad else ()))
        if entropy is not None and not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        p, targets, *rest = ctx.saved_tensors
        grad = p  # consumed: becomes the gradient in place
        if ctx.entropy_grad and grad_entropy is not None:
            z, expected = rest
            entropy_part = p * (expected.unsqueeze(-1) - z) * grad_entropy.unsqueeze(-1)
        else:
            entropy_part = None
        if grad_log_probs is not None:
            grad.mul_(-grad_log_probs.unsqueeze(-1))
            grad.scatter_add_(-1, targets.unsqueeze(-1), grad_log_probs.unsqueeze(-1))
        else:
            grad.zero_()
        if entropy_part is not None:
            grad.add_(entropy_part)
        return grad, None, None, None


# float32 logits of fewer elements take `_TargetLogProbs` (one [tokens x vocab] buffer, the fastest on CPU); 16-bit
# ones, or more, take `_ChunkedTargetLogProbs`, which never holds a float32 copy of them (at 24,576 rows x 151,936
# a copy is 15 GB): chunks of about CHUNK_ELEMENTS, the softmax recomputed per chunk in the backward
CHUNKED_FROM_ELEMENTS = 2**28
CHUNK_ELEMENTS = 2**23


class _ChunkedTargetLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[target] and the entropy, row chunk by row chunk in float32, for logits of any dtype.

    Saves the logits (alive for the output layer's backward anyway), the targets and one float per row (log Z, and
    E_p[z] with entropy): the backward recomputes each chunk's softmax and writes the gradient in the logits' dtype,
    the one [tokens x vocab] tensor it makes."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool, entropy_grad: bool, rows: int):
        n = logits.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=logits.device)
        log_z = torch.empty_like(log_probs)
        expected = torch.empty_like(log_probs) if with_entropy else None
        for start in range(0, n, rows):
            z = _scaled(logits[start:start + rows], temperature)
            lz = torch.logsumexp(z, dim=-1)
            log_z[start:start + rows] = lz
            log_probs[start:start + rows] = z.gather(-1, targets[start:start + rows].unsqueeze(-1)).squeeze(-1) - lz
            if with_entropy:
                expected[start:start + rows] = ((z - lz.unsqueeze(-1)).exp_() * z).sum(dim=-1)
        entropy = log_z - expected if with_entropy else None
        ctx.temperature, ctx.rows = temperature, rows
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(logits, targets, log_z, *((expected,) if ctx.entropy_grad else ()))
        if entropy is not None and not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, targets, log_z, *rest = ctx.saved_tensors
        grad = torch.empty_like(logits)
        entropy_grad = ctx.entropy_grad and grad_entropy is not None
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            z = _scaled(logits[start:end], ctx.temperature)
            p = (z - log_z[start:end].unsqueeze(-1)).exp_()
            g = p * (-grad_log_probs[start:end].unsqueeze(-1)) if grad_log_probs is not None else torch.zeros_like(p)
            if grad_log_probs is not None:
                g.scatter_add_(-1, targets[start:end].unsqueeze(-1), grad_log_probs[start:end].unsqueeze(-1))
            if entropy_grad:  # d H / dz = p * (E_p[z] - z)
                g.add_(p * (rest[0][start:end].unsqueeze(-1) - z) * grad_entropy[start:end].unsqueeze(-1))
            if ctx.temperature != 1.0:  # z = logits / T
                g.div_(ctx.temperature)
            grad[start:end] = g
        return grad, None, None, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk of logits in float32, divided by the temperature (may be the chunk itself: never written)."""
    return logits.float() / temperature if temperature != 1.0 else logits.float()


def _entropy(exp_shifted, shifted, sum_exp, log_z):
    expected_logit = reduce_from_tensor_model_parallel_region((exp_shifted * shifted).sum(dim=-1)) / sum_exp
    return log_z - expected_logit


def response_log_probs(logits: torch.Tensor, targets: torch.Tensor, response_lengths: list[int],
                       temperature: float, with_entropy: bool = False, entropy_grad: bool = True):
    """Per-sample log-probs (and entropy) of the response tokens.

    logits: [R, V/TP], the logits of each response token's predecessor position (`MicroBatchInputs.logit_rows`),
    targets: [R] the response tokens, in sample order. Returns lists of 1-D tensors of length response_lengths[i].
    """
    targets = targets.to(logits.device, non_blocking=True)  # from the host: the host does not wait for the copy
    lp, ent = vocab_parallel_log_probs(logits, targets, temperature, with_entropy, entropy_grad)
    split = list(response_lengths)
    return list(lp.split(split)), (list(ent.split(split)) if ent is not None else None)
