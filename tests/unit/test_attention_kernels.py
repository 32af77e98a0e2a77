"""The GPU paths of packed attention, checked on CPU: the packed-row read-back computed without a host read equals
the boolean mask's rows; `varlen_causal` hands torch's variable-length kernel what it needs (causal as the
installed torch spells it, grouped-query heads, int32 cu_seqlens) and gives what per-sequence causal SDPA gives (a
stand-in for the CUDA-only kernel here); the kernel is chosen only for CUDA 16-bit tensors."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.attention_reference import per_sequence_causal as _reference
from vime.trainer.megatron import attention
from vime.trainer.megatron.attention import padded_rows, padding_rows, uses_varlen_kernel, varlen_causal


@pytest.mark.parametrize("lengths", [[3, 1, 5], [1], [4, 4], [2, 7, 1, 1]])
def test_padded_rows_equal_the_real_mask(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    longest = max(lengths)
    real = (torch.arange(longest) < torch.tensor(lengths).unsqueeze(1)).view(-1)
    assert padded_rows(cu, sum(lengths), longest).tolist() == real.nonzero().view(-1).tolist()
    # and back: the padded layout reads each packed row once, in order, at its padded place; padding reads row 0
    gathered = padding_rows(cu, longest)
    assert gathered[padded_rows(cu, sum(lengths), longest)].tolist() == list(range(sum(lengths)))
    assert gathered[~real].tolist() == [0] * int((~real).sum())


@pytest.mark.parametrize("spelling", ["window_size", "is_causal"])
def test_varlen_causal_plumbing(monkeypatch, spelling):
    seen = {}

    def fake_varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, **kw):
        seen.update(kw, dtype=cu_q.dtype, max_q=max_q, heads=(query.shape[1], key.shape[1]))
        assert kw.get("window_size", (-1, 0)) == (-1, 0) and kw.get("is_causal", True)
        return _reference(query, key, value, cu_q, scale)

    if spelling == "window_size":
        def varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                   enable_gqa=False):
            return fake_varlen(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                               enable_gqa=enable_gqa)
    else:  # an older torch: is_causal, no enable_gqa
        def varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False):
            return fake_varlen(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 4, 16, generator=g), torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    cu = torch.tensor([0, 3, 4, 9])
    out = varlen_causal(q, k, v, cu, 5, 0.25)
    assert torch.allclose(out, _reference(q, k, v, cu, 0.25), atol=1e-6)
    assert seen["dtype"] == torch.int32 and seen["max_q"] == 5
    assert seen["heads"] == ((4, 2) if spelling == "window_size" else (4, 4))  # repeated where no enable_gqa


def test_the_varlen_kernel_only_for_cuda_16_bit():
    assert not uses_varlen_kernel(torch.zeros(2, 2, 2, dtype=torch.bfloat16))  # CPU
    assert not uses_varlen_kernel(torch.zeros(2, 2, 2, device="meta"))


def test_varlen_causal_folds_the_scale_into_the_queries_where_torch_takes_none(monkeypatch):
    """torch releases whose varlen_attn has no `scale` keyword (it scales by 1/sqrt(d)): the queries carry ours."""
    import math

    def varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, is_causal=False):  # the oldest spelling
        assert is_causal
        return _reference(query, key, value, cu_q, 1.0 / math.sqrt(query.shape[-1]))

    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, 4, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 3, 4, 9])
    assert torch.allclose(varlen_causal(q, k, v, cu, 5, 0.05), _reference(q, k, v, cu, 0.05), atol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_repeated_grouped_heads_give_what_enable_gqa_gives(monkeypatch, masked):
    """On CUDA `_attend` repeats grouped K/V heads where enable_gqa would send the call to the math kernel (a mask,
    or float32): the same output and gradients, checked here by forcing that branch on CPU."""
    from vime.trainer.megatron.attention import SDPAttention, expands_grouped_heads

    assert not expands_grouped_heads(torch.zeros(1, 4, 2, 8), torch.ones(1, 1, 2, 2, dtype=torch.bool))  # CPU
    assert not expands_grouped_heads(torch.zeros(1, 4, 2, 8, device="meta"), None)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 6, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 16, generator=g, requires_grad=True) for _ in range(2))
    mask = torch.ones(6, 6, dtype=torch.bool).tril().view(1, 1, 6, 6).expand(2, 1, 6, 6) if masked else None
    layer = SDPAttention.__new__(SDPAttention)  # `_attend` reads only the scale
    layer.softmax_scale = 0.3
    results = []
    for expand in (False, True):
        monkeypatch.setattr(attention, "expands_grouped_heads", lambda query, m, e=expand: e)
        out = layer._attend(q, k, v, 0.0, mask)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out, grads))
    (out_gqa, grads_gqa), (out_rep, grads_rep) = results
    assert torch.allclose(out_gqa, out_rep, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads_gqa, grads_rep))
