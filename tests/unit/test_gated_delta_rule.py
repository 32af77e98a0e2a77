"""The gated delta rule (vime/trainer/megatron/gated_delta_rule.py): the chunked form equals the step-by-step
reference and transformers' own Qwen3-Next implementation, forward and backward, for lengths that are and are not
a multiple of the chunk, with and without a state carried in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vime.trainer.megatron.gated_delta_rule import chunked_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule


def _inputs(seq: int, seed: int = 0, batch: int = 2, heads: int = 3, key_dim: int = 16, value_dim: int = 24):
    g = torch.Generator().manual_seed(seed)
    q, k = (l2_normalize(torch.randn(batch, seq, heads, key_dim, generator=g)) for _ in range(2))
    v = torch.randn(batch, seq, heads, value_dim, generator=g)
    decay = -F.softplus(torch.randn(batch, seq, heads, generator=g))  # a log, <= 0
    beta = torch.rand(batch, seq, heads, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("seq, chunk", [(1, 64), (37, 16), (64, 16), (130, 64)])
def test_chunked_rule_equals_the_step_by_step_rule(seq, chunk):
    inputs = _inputs(seq)
    state = torch.randn(2, 3, 16, 24, generator=torch.Generator().manual_seed(1)) * 0.1
    for initial in (None, state):
        expected, expected_state = recurrent_gated_delta_rule(*inputs, initial_state=initial)
        got, got_state = chunked_gated_delta_rule(*inputs, initial_state=initial, chunk_size=chunk)
        assert got.shape == expected.shape == (2, seq, 3, 24)
        assert (got - expected).abs().max().item() < 1e-5
        assert (got_state - expected_state).abs().max().item() < 1e-5
    # the decay matters: without it the outputs differ (the test would see a rule that ignored g)
    undecayed, _ = chunked_gated_delta_rule(*inputs[:3], torch.zeros_like(inputs[3]), inputs[4], chunk_size=chunk)
    assert seq == 1 or (undecayed - expected).abs().max().item() > 1e-2


def test_chunked_rule_equals_transformers_and_its_gradients_the_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, decay, beta = _inputs(100, seed=3)
    got, got_state = chunked_gated_delta_rule(q, k, v, decay, beta)
    hf, hf_state = torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, output_final_state=True)
    assert (got - hf).abs().max().item() < 1e-5 and (got_state - hf_state).abs().max().item() < 1e-5

    leaves = [t.clone().requires_grad_() for t in (q, k, v, decay, beta)]
    weights = torch.randn_like(got)
    (chunked_gated_delta_rule(*leaves, chunk_size=32)[0] * weights).sum().backward()
    chunked_grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    (recurrent_gated_delta_rule(*leaves)[0] * weights).sum().backward()
    for name, a, b in zip("q k v g beta".split(), chunked_grads, (t.grad for t in leaves)):
        assert (a - b).abs().max().item() < 1e-4 * max(1.0, b.abs().max().item()), name
