"""Rotary embeddings of packed (thd) sequences without host reads.

Megatron 0.16's unfused `_apply_rotary_pos_emb_thd` reads the packed boundaries on the host in every layer, for
queries and keys: `cu_seqlens.tolist()`, `cu_seqlens[i].item()` per sequence, and a comparison with
`cu_seqlens[-1]`. On a GPU each read waits for the device, 2 x layers x (sequences + 2) times per micro-batch.
`packed_rope_thd` computes the same rotation from the token count alone: with a table of one row per packed token
(what vime's `per_token_rope` gives shared prompts, Megatron's "exact mapping") the table is the packed
frequencies as it is; with a table of one row per position each token's row is its offset in its sequence,
gathered on the device. Context parallel (which vime does not run) keeps Megatron's own.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

_MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd


def token_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each of the `total` packed tokens' offset in its own sequence, on `cu_seqlens`' device."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=total)
    return torch.arange(total, device=cu.device) - cu[:-1].index_select(0, sequence)


def packed_rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                    multi_latent_attention: bool = False, mscale: float = 1.0, cp_group=None) -> torch.Tensor:
    """Megatron's `_apply_rotary_pos_emb_thd` (same arguments, same result) for one context-parallel rank."""
    if cp_group is None or cp_group.size() != 1:
        return _MEGATRON_THD(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
    total = t.shape[0]
    if freqs.shape[0] == total:  # one row per packed token: the rows are the packed frequencies
        packed = freqs
    else:
        packed = freqs.index_select(0, token_positions(cu_seqlens.to(freqs.device), total))
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)


def use_packed_rope() -> None:
    """Megatron's RoPE modules call `packed_rope_thd` for packed sequences from now on (idempotent)."""
    rope_utils._apply_rotary_pos_emb_thd = packed_rope_thd
    if hasattr(rotary_pos_embedding, "_apply_rotary_pos_emb_thd"):
        rotary_pos_embedding._apply_rotary_pos_emb_thd = packed_rope_thd
