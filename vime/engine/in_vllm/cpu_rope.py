"""vLLM 0.32's CPU rotary-embedding kernel, given queries and keys of different head counts as 3-D tensors.

`ops.rotary_embedding` on CPU rotates [tokens, heads, head_size] queries wrongly when the key has another head
count (measured: multi-latent attention's per-head rotary queries [tokens, heads, 64] with its one shared rotary
key [tokens, 1, 64] come out different from vLLM's own `forward_native` in every head, by up to 4.8; the same
tensors flattened to [tokens, heads x head_size] come out equal). DeepSeek-V2/V3's attention is the caller that
passes 3-D tensors; dense models pass 2-D ones and are not affected. A tiny DeepSeek-V3 served with the
unpatched kernel gives log-probs 0.018 away from transformers' (and from Megatron's); with the patch 1e-6.

`patch_cpu_rotary` makes the CPU path flatten 3-D inputs before the kernel and write the result back in place,
as the kernel does for its callers.
"""

from __future__ import annotations

import torch


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)  # a view when `t` is contiguous, else a copy


def patch_cpu_rotary() -> bool:
    """Patch vLLM's `RotaryEmbedding.forward_cpu` (once per process, CPU platform only); False where there is
    nothing to patch."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    original = RotaryEmbedding.forward_cpu
    if getattr(original, "vime_flattens_3d", False):
        return True

    def forward_cpu(self, positions, query, key=None):
        if query.dim() != 3 and (key is None or key.dim() != 3):
            return original(self, positions, query, key)
        flat_q = _flat(query)
        flat_k = None if key is None else _flat(key)
        flat_q, flat_k = original(self, positions, flat_q, flat_k)
        for t, flat in ((query, flat_q), (key, flat_k)):
            if t is not None and flat.data_ptr() != t.data_ptr():  # rotated a copy: write it back in place
                t.copy_(flat.view(t.shape))
        return query, key

    forward_cpu.vime_flattens_3d = True
    RotaryEmbedding.forward_cpu = forward_cpu
    return True
