"""Causal self-attention through torch's scaled-dot-product attention, for the local (non-TransformerEngine) spec.

Megatron's own `DotProductAttention` materialises the [b, heads, s, s] score matrix with baddbmm, a softmax and
a bmm, and refuses packed sequences. This drop-in subclass (same constructor, same parameters, same checkpoint
keys) calls `torch.nn.functional.scaled_dot_product_attention`, which picks a fused kernel where one exists
(flash attention on CPU too), and accepts Megatron's `thd` packed format (`PackedSeqParams` with cu_seqlens):
each packed sequence attends only to itself, all of them in one batched call. With shared prompts
(`SharedPromptSeqParams`, `vime.trainer.batching.shared_prompt_inputs`) a packed response segment attends to its
prompt segment and to itself.

Who uses it: `model_provider.build_gpt_model` puts it into the local layer spec, which vime builds on every device
(TransformerEngine's spec is not used: `model_provider.use_transformer_engine`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
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
        if isinstance(packed_seq_params, SharedPromptSeqParams):
            return self._shared_prompts(query, key, value, packed_seq_params.plan, dropout)
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, dropout)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._attend(q, k, v, dropout)  # [b, n, s, d]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    def _attend(self, q, k, v, dropout: float, mask: torch.Tensor | None = None):
        """[batch, heads, s, d] with key/value heads possibly fewer than query heads (grouped-query); causal, or
        where `mask` (True: attend) says."""
        if k.shape[1] != q.shape[1] and expands_grouped_heads(q, mask):
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                              scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])

    def _shared_prompts(self, query, key, value, plan: PromptSharingPlan, dropout: float):
        """Packed [t, n, d] with shared prompts: the segments that continue no other (prompts, whole samples) in one
        causal call, the responses, each after its prompt's keys and values, in one masked call; the real rows of
        both read back in packed order with one gather (its backward: one scatter-add)."""
        def gather(x, rows, batch):
            return x.index_select(0, rows).view(batch, -1, *x.shape[1:]).transpose(1, 2)

        outs = []
        if plan.alone_rows.numel():
            batch = plan.alone_segments
            out = self._attend(gather(query, plan.alone_rows, batch), gather(key, plan.alone_rows, batch),
                               gather(value, plan.alone_rows, batch), dropout)
            outs.append(out.transpose(1, 2).reshape(plan.alone_rows.numel(), -1))
        if plan.query_rows.numel():
            batch = plan.mask.shape[0]
            out = self._attend(gather(query, plan.query_rows, batch), gather(key, plan.key_rows, batch),
                               gather(value, plan.key_rows, batch), dropout, plan.mask)
            outs.append(out.transpose(1, 2).reshape(plan.query_rows.numel(), -1))
        return (torch.cat(outs) if len(outs) > 1 else outs[0]).index_select(0, plan.restore)  # [t, heads x d]

    def _packed(self, query, key, value, params, dropout: float):
        """Packed sequences [t, n, d]. On a GPU in 16-bit floats, torch's variable-length flash attention over
        cu_seqlens (no padding; `varlen_causal`). Elsewhere gathered into one right-padded [sequences, heads,
        longest, d] batch for a single causal call, then the real rows read back in packed order. A padded key sits
        after every real query of its row, so the causal mask keeps it out; padded queries' outputs are dropped
        (their gradient is 0). Neither path reads a device value on the host."""
        cu, longest = packed_bounds(params, query.device)
        if dropout == 0.0 and uses_varlen_kernel(query):
            out = varlen_causal(query, key, value, cu, longest, self.softmax_scale)
            return out.reshape(query.shape[0], -1)
        rows, batch = padding_rows(cu, longest), cu.numel() - 1
        q, k, v = (x.index_select(0, rows).view(batch, longest, *x.shape[1:]).transpose(1, 2)
                   for x in (query, key, value))  # [sequences, heads, longest, d]
        out = self._attend(q, k, v, dropout).transpose(1, 2).reshape(batch * longest, -1)
        return out.index_select(0, padded_rows(cu, query.shape[0], longest))  # [t, heads x d], packed order


def expands_grouped_heads(query: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `_attend` repeats grouped key/value heads up to the query heads itself. On CUDA only the flash kernel
    takes `enable_gqa`, and it takes no mask and no float32: a masked call (shared prompts) or a float32 one would
    fall back to the math kernel, which materialises every score matrix (at 4k tokens, 8 x 16 x 3072 x 4096 a
    layer). Repeated heads keep the memory-efficient kernel, for a copy of K and V. The CPU kernel takes both."""
    return query.is_cuda and (mask is not None or query.dtype == torch.float32)


def packed_bounds(params, device) -> tuple[torch.Tensor, int]:
    """(cu_seqlens as int64 on `device`, the longest sequence) of packed micro-batch parameters; the padded
    boundaries where there are (a sequence-parallel pad segment is a sequence of its own)."""
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu = cu.to(device, torch.long)
    longest = int(params.max_seqlen_q) if params.max_seqlen_q else int((cu[1:] - cu[:-1]).max())
    return cu, longest


def padding_rows(cu: torch.Tensor, longest: int) -> torch.Tensor:
    """For each row of the right-padded [sequences x longest] layout, the packed row it reads: a sequence's own
    rows, then row 0 for its padding (after every real row of the sequence, so a causal layer never lets it reach
    a real output). The inverse of `padded_rows`; no host read."""
    offsets = torch.arange(longest, device=cu.device)
    real = offsets < (cu[1:] - cu[:-1]).unsqueeze(1)
    return torch.where(real, cu[:-1].unsqueeze(1) + offsets, 0).view(-1)


def padded_rows(cu: torch.Tensor, total: int, longest: int) -> torch.Tensor:
    """For each of the `total` packed rows, its row in the right-padded [sequences x longest] layout, computed on
    the device without a host read (a boolean mask's `nonzero` would wait for the device)."""
    lengths = cu[1:] - cu[:-1]
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=total)
    return sequence * longest + torch.arange(total, device=cu.device) - cu[:-1].index_select(0, sequence)


def uses_varlen_kernel(query: torch.Tensor) -> bool:
    """torch's variable-length attention runs flash attention: CUDA, 16-bit floats."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.9
        return None
    return varlen_attn


def varlen_causal(query, key, value, cu: torch.Tensor, longest: int, scale: float | None) -> torch.Tensor:
    """Causal attention of packed [t, heads, d] sequences bounded by `cu`, through `varlen_attn` as the installed
    torch spells it (causal: `window_size=(-1, 0)` in newer releases, `is_causal` in older; grouped-query heads by
    `enable_gqa` where it exists, else repeated)."""
    import inspect

    attn = _varlen_attn()
    params = inspect.signature(attn).parameters
    kwargs = {}
    if scale is not None and "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None:  # a release whose varlen_attn has no scale (1/sqrt(d) always): fold ours into the queries
        query = query * (scale * math.sqrt(query.shape[-1]))
    kwargs.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    cu = cu.to(torch.int32)
    return attn(query, key, value, cu, cu, longest, longest, **kwargs)


@dataclass
class PromptSharingPlan:
    """Index tensors for `SDPAttention._shared_prompts`, built once per micro-batch (`prompt_sharing_plan`).

    alone_rows: the rows (of the packed row) of the `alone_segments` segments that continue none, right-padded to
    [segments x longest] (padding reads row 0; its outputs are never read back). query_rows / key_rows: each
    continuing segment's own rows, and its prompt's rows followed by its own, right-padded; mask [segments, 1,
    queries, keys]: a query sees the prompt and its own segment up to itself. restore: for each packed row, its
    row in the two padded outputs one after the other."""

    alone_segments: int
    alone_rows: torch.Tensor
    query_rows: torch.Tensor
    key_rows: torch.Tensor
    mask: torch.Tensor
    restore: torch.Tensor

    def to(self, device) -> PromptSharingPlan:
        """On `device`, without blocking the host (to a GPU from pinned memory)."""
        device = torch.device(device)

        def moved(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)

        return PromptSharingPlan(self.alone_segments, *(moved(getattr(self, f)) for f in
                                                         ("alone_rows", "query_rows", "key_rows", "mask", "restore")))


@functools.lru_cache(maxsize=64)
def cached_prompt_sharing_plan(cu_seqlens: tuple[int, ...], segment_prefix: tuple[int, ...]) -> PromptSharingPlan:
    """`prompt_sharing_plan`, built once per micro-batch layout: a rollout's passes (old log-probs, reference,
    every training step) see the same micro-batches. Its tensors are never written, so sharing them is safe."""
    return prompt_sharing_plan(list(cu_seqlens), list(segment_prefix))


def prompt_sharing_plan(cu_seqlens: list[int], segment_prefix: list[int]) -> PromptSharingPlan:
    """The plan for packed segments bounded by `cu_seqlens`, segment s continuing `segment_prefix[s]` (-1: none)."""
    starts, lengths = cu_seqlens[:-1], [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]

    def padded(row_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max((len(r) for r in row_lists), default=0)
        rows = torch.zeros(len(row_lists), longest, dtype=torch.long)
        real = torch.zeros(len(row_lists), longest, dtype=torch.bool)
        for i, r in enumerate(row_lists):
            rows[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            real[i, :len(r)] = True
        return rows, real

    def own(s: int) -> list[int]:
        return list(range(starts[s], starts[s] + lengths[s]))

    alone = [s for s, p in enumerate(segment_prefix) if p < 0]
    continuing = [s for s, p in enumerate(segment_prefix) if p >= 0]
    alone_rows, alone_real = padded([own(s) for s in alone])
    query_rows, query_real = padded([own(s) for s in continuing])
    key_rows, key_real = padded([own(segment_prefix[s]) + own(s) for s in continuing])
    before = torch.tensor([lengths[segment_prefix[s]] for s in continuing], dtype=torch.long)
    # key j is visible to query i when it is real and no later than the query: j <= prompt length + i
    visible = torch.arange(key_rows.shape[1]).view(1, 1, -1) <= before.view(-1, 1, 1) + \
        torch.arange(query_rows.shape[1]).view(1, -1, 1)
    mask = (visible & key_real.unsqueeze(1)).unsqueeze(1)
    rows, real = torch.cat([alone_rows.view(-1), query_rows.view(-1)]), torch.cat([alone_real.view(-1),
                                                                                  query_real.view(-1)])
    restore = torch.empty(cu_seqlens[-1], dtype=torch.long)
    restore[rows[real]] = real.nonzero().view(-1)
    return PromptSharingPlan(len(alone), alone_rows.view(-1), query_rows.view(-1), key_rows.view(-1), mask, restore)


@dataclass
class SharedPromptSeqParams(PackedSeqParams):
    """Megatron's `thd` PackedSeqParams (what RoPE and the layers read) with the shared-prompt plan attached."""

    plan: PromptSharingPlan | None = None
