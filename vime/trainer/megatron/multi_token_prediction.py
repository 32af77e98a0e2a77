"""Multi-token-prediction (MTP) layers as DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5 store them
(`hf_mtp_names`): held after the decoder on the last pipeline stage (`GPTModel.mtp.layers`), loaded from and saved
to the checkpoint's own MTP tensors, trained online with the trunk detached.

What one layer computes, as vLLM's drafter does (`vllm/model_executor/models/deepseek_mtp.py`, `glm4_moe_mtp.py`,
`qwen3_next_mtp.py`), so that the layers the trainer fits are the ones the engine drafts with: at position i it
reads the decoder's output h_i (after the final norm) and the embedding of token i + 1 (zero at position 0 for
DeepSeek-V3 and GLM-4.5; Qwen3-Next's and Qwen3.5's drafters read it there too), norms each (`enorm`, `hnorm`),
projects [embedding; hidden] to the hidden size (`eh_proj`), runs one transformer layer shaped like the decoder's
last attention layer (MoE where the model has experts) over the sequence, and norms the result
(`final_layernorm`); the shared output layer's logits at i predict token i + 2.

Training (`mtp_loss`): the trunk's output, the embedding and the output layer are read detached, so the MTP loss
reaches the MTP layers' parameters only: the policy's gradient is the same with and without it, bit for bit. The
MTP parameters are also marked `shared`, which Megatron's optimizer leaves out of the gradient norm it clips by, so
the policy's clipping is unchanged too.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

# the arguments of the decoder's forward that the MTP layer's transformer layer takes too
_LAYER_KWARGS = ("attention_mask", "rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "packed_seq_params",
                 "sequence_len_offset", "attention_bias")


def mtp_layer_config(config: TransformerConfig) -> TransformerConfig:
    """The MTP layers' config: the decoder's, without the router's auxiliary losses (a drafter needs no load
    balancing, and Megatron's loss tracker is sized for the decoder's layers)."""
    config = copy.copy(config)
    config.moe_aux_loss_coeff, config.moe_z_loss_coeff = 0.0, None
    config.moe_router_load_balancing_type = "none"
    config.moe_enable_routing_replay = False  # the engine reports the decoder's routing only
    return config


class MultiTokenPredictionLayer(MegatronModule):
    """One MTP layer (names as Megatron-LM's: enorm, hnorm, eh_proj, transformer_layer, final_layernorm)."""

    def __init__(self, config: TransformerConfig, layer_spec: ModuleSpec, layer_number: int, norm: Callable):
        super().__init__(config=config)
        hidden = config.hidden_size
        self.enorm = norm(config, hidden, eps=config.layernorm_epsilon)
        self.hnorm = norm(config, hidden, eps=config.layernorm_epsilon)
        self.eh_proj = ColumnParallelLinear(2 * hidden, hidden, config=config, init_method=config.init_method,
                                            bias=False, gather_output=True, skip_bias_add=False)
        self.transformer_layer = build_module(layer_spec, config=config, layer_number=layer_number)
        self.final_layernorm = norm(config, hidden, eps=config.layernorm_epsilon)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, **layer_kwargs) -> torch.Tensor:
        x, _ = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x, _ = self.transformer_layer(hidden_states=x, **layer_kwargs)
        return self.final_layernorm(x)


class MultiTokenPrediction(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_spec: ModuleSpec, num_layers: int, norm: Callable,
                 embeds_first_position: bool = False):
        config = mtp_layer_config(config)
        super().__init__(config=config)
        self.embeds_first_position = embeds_first_position  # else zero there (DeepSeek's drafter)
        self.layers = torch.nn.ModuleList([
            MultiTokenPredictionLayer(config, copy.deepcopy(layer_spec), config.num_layers + k + 1, norm)
            for k in range(num_layers)])

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Each layer's own (tensor- and expert-parallel shards as Megatron lays them out), under `layers.{k}.`."""
        out = {}
        for k, layer in enumerate(self.layers):
            out.update(layer.sharded_state_dict(f"{prefix}layers.{k}.", sharded_offsets, metadata))
        return out


def attach_mtp(gpt, layer_spec: ModuleSpec, num_layers: int, norm: Callable, trainable: bool,
               embeds_first_position: bool = False) -> None:
    """Give the last stage's `gpt` its MTP layers; frozen unless `trainable`."""
    gpt.mtp = MultiTokenPrediction(gpt.config, layer_spec, num_layers, norm, embeds_first_position).to(
        next(gpt.parameters()).device)
    for param in gpt.mtp.parameters():
        param.requires_grad = trainable
        param.shared = True  # out of the gradient norm the policy is clipped by (Megatron's param_is_not_shared)


def mtp_layers(gpt) -> int:
    """How many MTP layers a (last-stage) GPTModel holds."""
    return len(gpt.mtp.layers) if getattr(gpt, "mtp", None) is not None else 0


def mtp_trains(gpt) -> bool:
    """Whether `gpt` holds MTP layers that train (--enable-mtp-training)."""
    return mtp_layers(gpt) > 0 and any(p.requires_grad for p in gpt.mtp.parameters())


def decoder_modules(chunk: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The chunk's modules outside its MTP layers (the policy's: what routing replay and expert-load metrics
    count, per decoder layer)."""
    return (m for name, m in chunk.named_modules() if "mtp" not in name.split("."))


def shifted_tokens(tokens: torch.Tensor, positions: torch.Tensor, shift: int) -> torch.Tensor:
    """Each position's token `shift` places on in its own sequence; tokens and positions are [batch, seq]
    (packed: one row, positions restarting at 0 per sequence). Where the sequence has no such token the id is 0
    (never read: no target comes from there)."""
    out = torch.zeros_like(tokens)
    inside = positions[:, shift:] == positions[:, :-shift] + shift  # no new sequence begins in between
    out[:, :-shift] = torch.where(inside, tokens[:, shift:], 0)
    return out


def mtp_hidden(gpt, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
               layer_kwargs: dict) -> list[torch.Tensor]:
    """Each MTP layer's output ([seq, batch, hidden]) from the decoder's output `hidden`, all detached from the
    trunk: the layer k input reads token i + k + 1 at position i and the previous depth's output."""
    outputs, previous = [], hidden.detach()
    kwargs = {k: v for k, v in layer_kwargs.items() if k in _LAYER_KWARGS}
    for k, layer in enumerate(gpt.mtp.layers):
        with torch.no_grad():
            embedded = gpt.embedding(input_ids=shifted_tokens(tokens, positions, k + 1), position_ids=positions)
        if not gpt.mtp.embeds_first_position:  # as vLLM's DeepSeek / GLM drafter
            embedded = embedded * (positions.t() != 0).unsqueeze(-1).to(embedded.dtype)
        previous = layer(previous, embedded, **kwargs)
        outputs.append(previous)
    return outputs


def mtp_targets(logit_rows: torch.Tensor, positions: torch.Tensor, batch: int,
                depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, valid) of an MTP layer at `depth` (1 = the first), one of each per response token of the
    micro-batch, in order: the row of the flattened [seq x batch] hidden states (seq-major) it is predicted from,
    `depth` positions before its next-token row (`logit_rows`), and whether that position is still in the
    token's sequence (where it is not, the row is a stand-in to be weighted 0). `positions` is [batch, seq].
    Integer indexing and masks only: no host sync on a GPU."""
    position = positions.t().reshape(-1).index_select(0, logit_rows)  # the next-token row's position
    return (logit_rows - depth * batch).clamp(min=0), position >= depth
