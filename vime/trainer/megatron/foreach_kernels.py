"""torch's `_foreach_*` kernels in place of megatron-core's pure-Python fallbacks for apex's / TransformerEngine's
multi-tensor kernels, where neither is installed (every CPU machine; GPU machines without them).

Megatron's fallbacks (`megatron.core.utils.local_multi_tensor_l2_norm` / `local_multi_tensor_scale`) read every
gradient's norm back to the host (`torch.tensor` of a list of device scalars, then `float`): on a GPU one device-to-host
sync per gradient tensor in each optimizer step's clipping (about 300 for a 0.6B model), and a Python loop of one
kernel per tensor for the scaling. These compute the same values with one kernel launch per list and no host read.

    use_foreach_kernels()   # in every training process, before the optimizer steps; idempotent
"""

from __future__ import annotations

import torch


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for amp_C.multi_tensor_l2norm: the 2-norm of all tensors of `tensor_lists` together, a [1] float32
    tensor on their device; (norm, None) as apex returns it without per-tensor norms."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for amp_C.multi_tensor_scale: dst = src * scale for each pair of `tensor_lists`."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_kernels() -> list[str]:
    """Put the foreach kernels where megatron-core took its Python fallbacks; returns the names replaced ([] where
    apex or TransformerEngine provide the real kernels)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    replaced = []
    for module, name, fallback, ours in ((clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, foreach_l2_norm),
                                         (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale,
                                          foreach_scale),
                                         (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale,
                                          foreach_scale)):
        if getattr(module, name, None) is fallback:
            setattr(module, name, ours)
            replaced.append(f"{module.__name__}.{name}")
    return replaced
