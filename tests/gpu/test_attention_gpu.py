"""Packed attention on a GPU: torch's variable-length flash kernel (bf16) gives what per-sequence causal SDPA
gives, and neither packed path reads a device value on the host (`torch.cuda.set_sync_debug_mode`)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.attention_reference import per_sequence_causal as _reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_varlen_kernel_matches_causal_sdpa_without_a_host_sync():
    from vime.trainer.megatron.attention import padded_rows, uses_varlen_kernel, varlen_causal

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 300, 5, 128]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    t = sum(lengths)
    q = torch.randn(t, 16, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    assert uses_varlen_kernel(q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = varlen_causal(q, k, v, cu, max(lengths), 0.125)
        rows = padded_rows(cu, t, max(lengths))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = _reference(q.float(), k.float(), v.float(), cu, 0.125)
    assert (out.float() - ref).abs().max().item() < 2e-2
    real = (torch.arange(max(lengths), device="cuda") < torch.tensor(lengths, device="cuda").unsqueeze(1)).view(-1)
    assert torch.equal(rows, real.nonzero().view(-1))


@pytest.mark.parametrize("dtype,masked", [(torch.bfloat16, True), (torch.float32, True), (torch.float32, False)])
def test_grouped_query_attention_never_takes_the_math_kernel(dtype, masked):
    """Shared prompts (a mask) and float32 training with grouped-query heads: with the math kernel forbidden the call
    still runs (`expands_grouped_heads` keeps it on the memory-efficient kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vime.trainer.megatron.attention import SDPAttention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 16, 256, 64, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(4, 8, 256, 64, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    mask = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril().expand(4, 1, 256, 256) if masked else None
    layer = SDPAttention.__new__(SDPAttention)
    layer.softmax_scale = 0.125
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        out = layer._attend(q, k, v, 0.0, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1), attn_mask=mask,
        is_causal=mask is None, scale=0.125)
    assert (out.float() - ref).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-4)
