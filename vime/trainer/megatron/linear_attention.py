"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5's hybrid layers, as a Megatron self-attention
module: what vime's layer spec puts where the config's `layer_types` says "linear_attention".

megatron-core 0.16.1 has a GatedDeltaNet of its own, but it needs flash-linear-attention (CUDA, Triton) even for its
torch fallback and refuses packed sequences; this one runs on any device, takes vime's packed (thd) micro-batches
and splits over tensor parallel like Megatron's.

Data path (per layer): `in_proj` (column parallel) gives, on each TP rank, its share of the key heads and of the
value heads, laid out [q | k | v | z | b | a]; a causal depthwise convolution over q, k, v (kernel
`linear_conv_kernel_dim`) then SiLU; q and k L2-normalised and repeated to the value heads; decay
g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b); the gated delta rule
(`gated_delta_rule`); an RMSNorm per value head gated by SiLU(z); `out_proj` (row parallel).

Packed sequences are gathered into one right-padded batch, one row per sequence, so no sequence's convolution or
recurrent state sees another's tokens; the rows are read back in packed order. No value is read on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule

from vime.trainer.megatron.attention import packed_bounds, padded_rows, padding_rows
from vime.trainer.megatron.gated_delta_rule import chunked_gated_delta_rule, l2_normalize


class GatedDeltaNetAttention(MegatronModule):
    """A Gated DeltaNet layer in Megatron's self-attention slot (same call, returns (output, bias))."""

    def __init__(self, config, submodules=None, layer_number: int = 1, pg_collection=None, **_unused):
        super().__init__(config)
        self.layer_number = layer_number
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.key_heads, self.value_heads = config.linear_num_key_heads // tp, config.linear_num_value_heads // tp
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        global_in = 2 * config.linear_num_key_heads * self.key_dim + \
            2 * config.linear_num_value_heads * self.value_dim + 2 * config.linear_num_value_heads
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, global_in, config=config, init_method=config.init_method, bias=False,
            gather_output=False, skip_bias_add=True, is_expert=False)
        self.conv_channels = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
        device = torch.device("cpu") if config.use_cpu_initialization else None
        self.conv1d_weight = torch.nn.Parameter(
            torch.empty(self.conv_channels, 1, self.kernel, dtype=config.params_dtype, device=device))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads, dtype=config.params_dtype, device=device))
        self.A_log = torch.nn.Parameter(torch.zeros(self.value_heads, dtype=config.params_dtype, device=device))
        for param in (self.conv1d_weight, self.dt_bias, self.A_log):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
        with torch.no_grad():
            torch.nn.init.normal_(self.conv1d_weight, std=config.init_method_std)
        self.out_norm_weight = torch.nn.Parameter(
            torch.ones(self.value_dim, dtype=config.params_dtype, device=device))
        self.out_norm_weight.sequence_parallel = config.sequence_parallel  # replicated, like the other norms
        self.eps = config.layernorm_epsilon
        self.out_proj = tensor_parallel.RowParallelLinear(
            config.linear_num_value_heads * self.value_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **_unused):
        projected, _ = self.in_proj(hidden_states)  # [s, b, local] (thd: [t, 1, local])
        if packed_seq_params is not None:
            if getattr(packed_seq_params, "plan", None) is not None:
                raise ValueError("Gated DeltaNet layers cannot read a shared prompt: each response needs the "
                                 "recurrent state its own prompt left (prompt sharing is off for such models)")
            cu, longest = packed_bounds(packed_seq_params, projected.device)
            batch, total = cu.numel() - 1, projected.shape[0]
            x = projected.view(total, -1).index_select(0, padding_rows(cu, longest)).view(batch, longest, -1)
            out = self._mix(x)  # [sequences, longest, local]: causal, so no padding row reaches a real one
            out = out.reshape(batch * longest, -1).index_select(0, padded_rows(cu, total, longest))[:, None]
        else:
            out = self._mix(projected.transpose(0, 1)).transpose(0, 1)
        return self.out_proj(out.contiguous())

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, in_proj's local outputs] -> [batch, seq, value heads x value dim]."""
        b, s, _ = x.shape
        kd, vd = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        qkv, z, beta, a = x.split([self.conv_channels, vd, self.value_heads, self.value_heads], dim=-1)
        qkv = F.silu(F.conv1d(qkv.transpose(1, 2), self.conv1d_weight, padding=self.kernel - 1,
                              groups=self.conv_channels)[..., :s]).transpose(1, 2)
        q, k, v = qkv.split([kd, kd, vd], dim=-1)
        repeat = self.value_heads // self.key_heads
        q, k = (l2_normalize(t.reshape(b, s, self.key_heads, self.key_dim).float())
                .repeat_interleave(repeat, dim=2) for t in (q, k))
        v = v.reshape(b, s, self.value_heads, self.value_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        core, _ = chunked_gated_delta_rule(q, k, v, g, beta.float().sigmoid())
        core = core.float()
        normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps) * self.out_norm_weight.float()
        gated = normed * F.silu(z.reshape(b, s, self.value_heads, self.value_dim).float())
        return gated.to(x.dtype).reshape(b, s, vd)
