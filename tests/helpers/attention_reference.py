"""Causal attention of packed sequences, one SDPA call per sequence: the reference the packed kernels are held to."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sequence_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                        scale: float | None) -> torch.Tensor:
    """Packed [t, heads, d] queries / keys / values bounded by `cu` -> [t, heads, d]."""
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=ks.shape[0] != qs.shape[0]).transpose(0, 1))
    return torch.cat(outs)
