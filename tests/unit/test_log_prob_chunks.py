"""The chunked log-prob / entropy function (`log_probs._ChunkedTargetLogProbs`, taken for 16-bit or large logits):
the same log-probs, entropy and gradients as log_softmax over the whole [tokens x vocab] block, for any chunking, at
any temperature, with the entropy's gradient or without; bfloat16 logits get bfloat16 gradients and no float32 copy
of the whole block."""

from __future__ import annotations

import pytest
import torch

from vime.trainer import log_probs as lp_module
from vime.trainer.log_probs import _ChunkedTargetLogProbs


def _reference(logits, targets, temperature):
    z = logits.double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("rows", [1, 3, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_chunked_equals_the_whole_block(rows, temperature, entropy_grad):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(11, 50, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 50, (11,), generator=g)
    weights = torch.randn(11, generator=g, dtype=torch.float64)
    log_probs, entropy = _ChunkedTargetLogProbs.apply(logits, targets, temperature, True, entropy_grad, rows)
    ref_lp, ref_ent = _reference(logits, targets, temperature)
    assert torch.allclose(log_probs.double(), ref_lp, atol=1e-5) and torch.allclose(entropy.double(), ref_ent,
                                                                                    atol=1e-5)
    loss = (log_probs.double() * weights).sum() + (entropy.double().sum() if entropy_grad else 0.0)
    ref_loss = (ref_lp * weights).sum() + (ref_ent.sum() if entropy_grad else 0.0)
    grad, = torch.autograd.grad(loss, logits)
    ref_grad, = torch.autograd.grad(ref_loss, logits)
    assert torch.allclose(grad.double(), ref_grad.double(), atol=1e-5)


def test_16_bit_logits_take_the_chunks_and_keep_their_dtype(monkeypatch):
    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", 3 * 64)  # three rows a chunk
    monkeypatch.setattr(lp_module, "_vocab_range", lambda: (0, 1))  # one tensor-parallel rank
    logits = torch.randn(10, 64).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 64, (10,))
    log_probs, entropy = lp_module.vocab_parallel_log_probs(logits, targets, 1.0, with_entropy=True)
    assert log_probs.grad_fn is not None and "Chunked" in type(log_probs.grad_fn).__name__
    log_probs.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_lp, _ = _reference(logits.detach().float(), targets, 1.0)
    assert torch.allclose(log_probs.double(), ref_lp, atol=1e-4)
