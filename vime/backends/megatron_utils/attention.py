"""Causal self-attention through torch's scaled-dot-product attention, for the local (non-TransformerEngine) spec.

Megatron's own `DotProductAttention` materialises the [b, heads, s, s] score matrix with baddbmm, a softmax and
a bmm, and refuses packed sequences. This drop-in subclass (same constructor, same parameters, same checkpoint
keys) calls `torch.nn.functional.scaled_dot_product_attention`, which picks a fused kernel where one exists
(flash attention on CPU too), and accepts Megatron's `thd` packed format (`PackedSeqParams` with cu_seqlens):
each packed sequence attends only to itself, all of them in one batched call.

Who uses it: `model_provider.build_gpt_model` puts it into the local layer spec. The TransformerEngine spec on
GPUs has its own fused attention with `thd` support.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SDPAttention(DotProductAttention):
    """Core attention: query [s, b, heads, d] (or [t, heads, d] packed), key/value with query groups -> [s, b, h].
    Multi-latent attention passes its head sizes: queries/keys of `k_channels`, values of `v_channels`."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # the output is heads x the value head size
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("SDPAttention computes causal attention itself; it takes no mask or bias")
        if self.softmax_offset is not None:
            raise ValueError(f"softmax_type {self.config.softmax_type!r} needs Megatron's DotProductAttention")
        dropout = self.attention_dropout.p if self.training else 0.0
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, dropout)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._attend(q, k, v, dropout)  # [b, n, s, d]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    def _attend(self, q, k, v, dropout: float):
        """[batch, heads, s, d] with key/value heads possibly fewer than query heads (grouped-query)."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def _packed(self, query, key, value, params, dropout: float):
        """Packed sequences [t, n, d]: gathered into one right-padded [sequences, heads, longest, d] batch for a
        single causal call, then the real rows read back in packed order. A padded key sits after every real query
        of its row, so the causal mask keeps it out; padded queries' outputs are dropped (their gradient is 0)."""
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu = cu.to(query.device, torch.long)
        lengths = cu[1:] - cu[:-1]
        longest = int(params.max_seqlen_q) if params.max_seqlen_q else int(lengths.max())
        offsets = torch.arange(longest, device=query.device)
        real = (offsets < lengths.unsqueeze(1)).view(-1)  # [sequences x longest]
        rows = torch.where(real, (cu[:-1].unsqueeze(1) + offsets).view(-1), 0)  # padding reads row 0, never used
        batch = lengths.numel()
        q, k, v = (x.index_select(0, rows).view(batch, longest, *x.shape[1:]).transpose(1, 2)
                   for x in (query, key, value))  # [sequences, heads, longest, d]
        out = self._attend(q, k, v, dropout).transpose(1, 2).reshape(batch * longest, -1)
        return out.index_select(0, real.nonzero().view(-1))  # [t, heads x d], packed order
