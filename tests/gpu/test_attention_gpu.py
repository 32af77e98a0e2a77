"""Packed attention on a GPU: torch's variable-length flash kernel (bf16) gives what per-sequence causal SDPA
gives, and neither packed path reads a device value on the host (`torch.cuda.set_sync_debug_mode`)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.attention_reference import per_sequence_causal as _reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_varlen_kernel_matches_causal_sdpa_without_a_host_sync():
    from vime.backends.megatron_utils.attention import padded_rows, uses_varlen_kernel, varlen_causal

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
