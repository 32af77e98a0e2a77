"""torch's foreach kernels in place of megatron-core's Python fallbacks (no apex or TransformerEngine here): the same
gradient norm and scaling, and no host read: on the meta device (which, like CUDA, has no host values) Megatron's
fallback fails where the foreach norm runs."""

from __future__ import annotations

import pytest
import torch
from megatron.core import utils

from vime.trainer.megatron.foreach_kernels import foreach_l2_norm, foreach_scale, use_foreach_kernels


def _grads(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g).to(device) for n in (7, 300, 1, 64)]


def test_the_same_norm_and_scale_as_megatrons_fallbacks():
    grads = _grads()
    ours, _ = foreach_l2_norm(2048, None, [grads[:2], grads[2:]], False)
    expected = torch.linalg.vector_norm(torch.cat([g.view(-1) for g in grads]))
    assert torch.allclose(ours, expected.reshape(1), rtol=1e-6)
    mine, theirs = [g.clone() for g in grads], [g.clone() for g in grads]
    foreach_scale(2048, None, [mine, mine], 0.25)
    for src, dst in zip([g.clone() for g in grads], theirs):
        dst.copy_(src * 0.25)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    out = [torch.empty_like(g) for g in grads]
    foreach_scale(2048, None, [grads, out], 2.0)
    assert all(torch.equal(o, g * 2.0) for o, g in zip(out, grads))


def test_no_host_read_where_megatrons_fallback_needs_one():
    grads = _grads("meta")
    norm, _ = foreach_l2_norm(2048, None, [grads], False)
    assert norm.device.type == "meta" and norm.shape == (1,)
    with pytest.raises((NotImplementedError, RuntimeError)):
        utils.local_multi_tensor_l2_norm(2048, None, [grads], False)  # float() of a device value


def test_megatrons_fallbacks_are_replaced():
    from megatron.core.optimizer import clip_grads, optimizer

    use_foreach_kernels()
    assert clip_grads.l2_norm_impl is foreach_l2_norm and clip_grads.multi_tensor_scale_impl is foreach_scale
    assert optimizer.multi_tensor_scale_impl is foreach_scale
    assert use_foreach_kernels() == []  # idempotent
