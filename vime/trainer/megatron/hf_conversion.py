"""HF (Qwen2 / Qwen3 / Llama / Qwen3-MoE / DeepSeek-V3 / GLM-4.5) <-> Megatron-core GPTModel weights, with tensor-,
pipeline- and expert-parallel sharding.

Layout facts (megatron-core 0.16.1, local layer spec; a naive q|k|v concat gives wrong logits):
- `linear_qkv` stacks, per KV group g, [q heads of g | k_g | v_g] (weight [G*(H/G+2)*D, hidden], bias alike);
  TP ranks hold contiguous row blocks of that interleaved tensor.
- `linear_fc1` is [gate; up]; TP rank r holds [gate_r; up_r] (each half split separately).
- Column-parallel (split rows): linear_qkv, linear_fc1, word embeddings, output layer.
  Row-parallel (split columns): linear_proj, linear_fc2. Norms are replicated.
- Local spec norms are `input_layernorm` / `pre_mlp_layernorm`; the TransformerEngine spec fuses them into
  `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` (both are understood here).
- Module names use local layer indices; the global layer is `layer_number - 1`.
- Tied embeddings: with one pipeline stage the model has no output weight; with several, the last stage keeps
  a copy of the embedding as `output_layer.weight`, which HF does not store.
- MoE layers: `mlp.router.weight` is HF's `mlp.gate.weight` (replicated); expert-parallel rank r holds experts
  [r * E/EP, (r + 1) * E/EP) as `mlp.experts.local_experts.{local index}.linear_fc1/2`, each laid out like a
  dense MLP (fc1 = [gate; up]) and split over tensor parallel the same way (expert TP = TP).
  DeepSeek-V3 and GLM-4.5 add the router's `expert_bias` buffer (HF `mlp.gate.e_score_correction_bias`) and
  `mlp.shared_experts.linear_fc1/2` (HF `mlp.shared_experts.gate/up/down_proj`, laid out like a dense MLP).
- Multi-latent attention (local spec): every projection is a plain copy of its HF matrix. The down projections
  (`linear_q_down_proj` = `q_a_proj`, `linear_kv_down_proj` = `kv_a_proj_with_mqa`) are column-parallel with
  their output gathered, so TP splits their rows like the up projections' (`linear_q_up_proj` = `q_b_proj`,
  `linear_kv_up_proj` = `kv_b_proj`, one head's rows after another); `q_layernorm` / `kv_layernorm` are
  `q_a_layernorm` / `kv_a_layernorm`. HF's interleaved rotary pairs need no permutation: Megatron's MLA rotates
  interleaved pairs too.

Pure functions on state dicts; `hf_checkpoint` applies them to live models (loading, streaming, saving).
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass
from typing import Mapping

import torch

from vime.trainer.megatron.hf_architecture import MTP_UNDER_MTP, MULTIMODAL_WRAPPERS, hf_architecture, language_config
from vime.trainer.megatron.hf_mtp_names import MTP_PARAMS, MTP_RE, mtp_param


@dataclass(frozen=True)
class Arch:
    num_layers: int
    heads: int
    groups: int
    head_dim: int
    tied: bool
    qk_norm: bool
    qkv_bias: bool
    moe_layers: tuple[int, ...] = ()  # per global layer: 1 = MoE, 0 = dense (empty: a dense model)
    num_experts: int = 0
    mla: bool = False  # multi-latent attention
    q_lora: bool = False  # MLA with a low-rank query (q_lora_rank set)
    shared_experts: bool = False
    expert_bias: bool = False
    # Qwen3-Next: per global layer 1 = Gated DeltaNet (empty: no linear attention), its heads and head sizes, the
    # full-attention layers' output gate, and the one shared expert behind a sigmoid gate (HF `mlp.shared_expert`)
    linear_layers: tuple[int, ...] = ()
    linear_heads: tuple[int, int, int, int] = (0, 0, 0, 0)  # key heads, value heads, key dim, value dim
    output_gate: bool = False
    shared_expert_gate: bool = False
    split_linear_in_proj: bool = False  # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3-Next: 2)
    prefix: str = "model."  # where the language model's tensors are ("model.language_model." in a multimodal one)
    mtp_layers: int = 0  # multi-token-prediction layers the Megatron model holds (HF: layers from num_layers on)
    mtp_under_mtp: bool = False  # ... stored under `mtp.` instead (Qwen3-Next, Qwen3.5: hf_architecture.MTP_UNDER_MTP)

    @classmethod
    def from_hf(cls, hf_config, mtp_layers: int = 0) -> "Arch":
        a = hf_architecture(hf_config)
        multimodal = hf_config.model_type in MULTIMODAL_WRAPPERS
        text = language_config(hf_config)
        return cls(a["num_layers"], a["num_attention_heads"], a["num_query_groups"], a["kv_channels"],
                   not a["untie_embeddings_and_output_weights"], a["qk_layernorm"], a["add_qkv_bias"],
                   tuple(a["moe_layer_freq"] or ()), a["num_experts"] or 0, bool(a["multi_latent_attention"]),
                   a["q_lora_rank"] is not None, bool(a["moe_shared_expert_intermediate_size"]),
                   bool(a["moe_router_enable_expert_bias"]), tuple(a["linear_attention_freq"] or ()),
                   (a["linear_num_key_heads"] or 0, a["linear_num_value_heads"] or 0, a["linear_key_head_dim"] or 0,
                    a["linear_value_head_dim"] or 0), bool(a["attention_output_gate"]),
                   bool(a["moe_shared_expert_gate"]), text.model_type in ("qwen3_5_text", "qwen3_5_moe_text"),
                   "model.language_model." if multimodal else "model.", mtp_layers, text.model_type in MTP_UNDER_MTP)

    def is_moe(self, layer: int) -> bool:  # an MTP layer (past the decoder's) is shaped like the last one
        return bool(self.moe_layers) and bool(self.moe_layers[min(layer, self.num_layers - 1)])

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and layer < self.num_layers and bool(self.linear_layers[layer])


@dataclass(frozen=True)
class _Param:
    """How one Megatron parameter maps to HF: kind is "copy", "qkv" or "fc1"; split_dim None = replicated."""
    kind: str
    hf_names: tuple[str, ...]
    split_dim: int | None


# Per-layer Megatron suffix -> (kind, HF suffixes under model.layers.{L}., TP split dim).
_LAYER_PARAMS = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",), None),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ("input_layernorm.weight",), None),  # TE spec
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight"), 0),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                "self_attn.v_proj.bias"), 0),
    "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",), 1),
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_norm.weight",), None),
    "self_attention.k_layernorm.weight": ("copy", ("self_attn.k_norm.weight",), None),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",), None),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ("post_attention_layernorm.weight",), None),  # TE spec
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0),
    "mlp.linear_fc2.weight": ("copy", ("mlp.down_proj.weight",), 1),
    # multi-latent attention
    "self_attention.linear_q_proj.weight": ("copy", ("self_attn.q_proj.weight",), 0),
    "self_attention.linear_q_down_proj.weight": ("copy", ("self_attn.q_a_proj.weight",), 0),
    "self_attention.linear_q_up_proj.weight": ("copy", ("self_attn.q_b_proj.weight",), 0),
    "self_attention.linear_q_up_proj.layer_norm_weight": ("copy", ("self_attn.q_a_layernorm.weight",), None),  # TE
    "self_attention.linear_kv_down_proj.weight": ("copy", ("self_attn.kv_a_proj_with_mqa.weight",), 0),
    "self_attention.linear_kv_up_proj.weight": ("copy", ("self_attn.kv_b_proj.weight",), 0),
    "self_attention.linear_kv_up_proj.layer_norm_weight": ("copy", ("self_attn.kv_a_layernorm.weight",), None),  # TE
    "self_attention.kv_layernorm.weight": ("copy", ("self_attn.kv_a_layernorm.weight",), None),
}
_MLA_Q_NORM = ("copy", ("self_attn.q_a_layernorm.weight",), None)  # MLA's q_layernorm is the query latent's norm
# Gated DeltaNet layers (vime/trainer/megatron/linear_attention.py), HF's `linear_attn`
_LINEAR_PARAMS = {
    "self_attention.in_proj.weight": ("gdn_in", ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"),
                                      0),
    "self_attention.conv1d_weight": ("gdn_conv", ("linear_attn.conv1d.weight",), 0),
    "self_attention.dt_bias": ("copy", ("linear_attn.dt_bias",), 0),
    "self_attention.A_log": ("copy", ("linear_attn.A_log",), 0),
    "self_attention.out_norm_weight": ("copy", ("linear_attn.norm.weight",), None),
    "self_attention.out_proj.weight": ("copy", ("linear_attn.out_proj.weight",), 1),
}
# Qwen3.5's input projection: q, k, v (each whole, key heads in order), z, b, a are Megatron's blocks already
_SPLIT_IN_PROJ = ("gdn_in4", tuple(f"linear_attn.in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")), 0)
_GATED_QKV = ("qkvg", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), 0)
# Qwen3-Next's one shared expert, and its sigmoid gate
_GATED_SHARED_EXPERT = {
    "mlp.shared_experts.linear_fc1.weight": ("fc1", ("mlp.shared_expert.gate_proj.weight",
                                                     "mlp.shared_expert.up_proj.weight"), 0),
    "mlp.shared_experts.linear_fc2.weight": ("copy", ("mlp.shared_expert.down_proj.weight",), 1),
    "mlp.shared_experts.gate_weight": ("copy", ("mlp.shared_expert_gate.weight",), None),
}
# MoE layers: the router, and each expert's MLP (local index -> global expert = EP rank * local count + index)
_MOE_PARAMS = {
    "mlp.router.weight": ("copy", ("mlp.gate.weight",), None),
    "mlp.router.expert_bias": ("copy", ("mlp.gate.e_score_correction_bias",), None),  # a buffer, not a parameter
    "mlp.shared_experts.linear_fc1.weight": ("fc1", ("mlp.shared_experts.gate_proj.weight",
                                                     "mlp.shared_experts.up_proj.weight"), 0),
    "mlp.shared_experts.linear_fc2.weight": ("copy", ("mlp.shared_experts.down_proj.weight",), 1),
    "linear_fc1.weight": ("fc1", ("gate_proj.weight", "up_proj.weight"), 0),
    "linear_fc2.weight": ("copy", ("down_proj.weight",), 1),
}
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
TE_FUSED_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                  "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
                  "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",  # MLA
                  "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def param_for(name: str, arch: Arch, layer_offset: int, expert_offset: int = 0) -> _Param | None:
    """The HF mapping of a Megatron parameter name of a chunk; None for the tied copy of the embedding.
    `expert_offset`: the global index of this rank's first local expert."""
    mtp = MTP_RE.match(name)
    if mtp:  # its own tensors, or its transformer layer, which maps like a decoder layer after the last
        return _Param(*mtp_param(int(mtp.group(1)), mtp.group(2), arch, lambda layer, rest: astuple(param_for(
            f"decoder.layers.{layer - layer_offset}.{rest}", arch, layer_offset, expert_offset))))
    m = _LAYER_RE.match(name)
    if m:
        prefix = f"{arch.prefix}layers.{int(m.group(1)) + layer_offset}."
        expert = _EXPERT_RE.match(m.group(2))
        if expert:
            kind, hf_suffixes, split_dim = _MOE_PARAMS[expert.group(2)]
            prefix += f"mlp.experts.{int(expert.group(1)) + expert_offset}."
        elif arch.mla and m.group(2) == "self_attention.q_layernorm.weight":
            kind, hf_suffixes, split_dim = _MLA_Q_NORM
        elif arch.split_linear_in_proj and m.group(2) == "self_attention.in_proj.weight":
            kind, hf_suffixes, split_dim = _SPLIT_IN_PROJ
        elif m.group(2) in _LINEAR_PARAMS:
            kind, hf_suffixes, split_dim = _LINEAR_PARAMS[m.group(2)]
        elif arch.output_gate and m.group(2) == "self_attention.linear_qkv.weight":
            kind, hf_suffixes, split_dim = _GATED_QKV
        elif arch.shared_expert_gate and m.group(2) in _GATED_SHARED_EXPERT:
            kind, hf_suffixes, split_dim = _GATED_SHARED_EXPERT[m.group(2)]
        else:
            kind, hf_suffixes, split_dim = _MOE_PARAMS.get(m.group(2)) or _LAYER_PARAMS[m.group(2)]
        return _Param(kind, tuple(prefix + s for s in hf_suffixes), split_dim)
    if name == "embedding.word_embeddings.weight":
        return _Param("copy", (f"{arch.prefix}embed_tokens.weight",), 0)
    if name == "decoder.final_layernorm.weight":
        return _Param("copy", (f"{arch.prefix}norm.weight",), None)
    if name == "output_layer.weight":
        return None if arch.tied else _Param("copy", ("lm_head.weight",), 0)
    raise KeyError(f"no HF mapping for Megatron parameter {name!r}")


def _chunk_param_names(arch: Arch, num_local_layers: int, pre_process: bool, post_process: bool,
                       layer_offset: int = 0, num_local_experts: int = 0) -> list[str]:
    """Megatron parameter names (local spec) of a chunk holding `num_local_layers` layers from `layer_offset`
    (MoE layers with `num_local_experts` experts each)."""
    suffixes = ["input_layernorm.weight", "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight"]
    if arch.mla:
        suffixes += ["self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.weight",
                     "self_attention.kv_layernorm.weight"]
        suffixes += (["self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.weight",
                      "self_attention.q_layernorm.weight"] if arch.q_lora else ["self_attention.linear_q_proj.weight"])
    else:
        suffixes.append("self_attention.linear_qkv.weight")
        if arch.qkv_bias:
            suffixes.append("self_attention.linear_qkv.bias")
        if arch.qk_norm:
            suffixes += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    linear = ["input_layernorm.weight", "pre_mlp_layernorm.weight", *(f"self_attention.{n}" for n in (
        "in_proj.weight", "conv1d_weight", "dt_bias", "A_log", "out_norm_weight", "out_proj.weight"))]
    dense = ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    moe = ["mlp.router.weight"] + [f"mlp.experts.local_experts.{e}.linear_fc{k}.weight"
                                   for e in range(num_local_experts) for k in (1, 2)]
    if arch.expert_bias:
        moe.append("mlp.router.expert_bias")
    if arch.shared_experts:
        moe += ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"]
    if arch.shared_expert_gate:
        moe.append("mlp.shared_experts.gate_weight")
    names = [f"decoder.layers.{i}.{s}" for i in range(num_local_layers)
             for s in (linear if arch.is_linear(layer_offset + i) else suffixes)
             + (moe if arch.is_moe(layer_offset + i) else dense)]
    if pre_process:
        names.insert(0, "embedding.word_embeddings.weight")
    if post_process:
        names.append("decoder.final_layernorm.weight")
        if not arch.tied or not pre_process:
            names.append("output_layer.weight")
        for k in range(arch.mtp_layers):  # after the decoder, shaped like its last layer
            names += [f"mtp.layers.{k}.{s}" for s in MTP_PARAMS]
            names += [f"mtp.layers.{k}.transformer_layer.{s}"
                      for s in suffixes + (moe if arch.is_moe(arch.num_layers + k) else dense)]
    return names


# ---- full (unsharded) Megatron tensor <-> HF tensors ----

def _sections(p: _Param, arch: Arch, rows: int) -> list[int] | None:
    """The row blocks of a full Megatron tensor that tensor parallel splits one by one (each rank holds its share
    of every block, in order), or None for a plain split."""
    key_heads, value_heads, key_dim, value_dim = arch.linear_heads
    if p.kind == "fc1":
        return [rows // 2, rows // 2]
    if p.kind in ("gdn_in", "gdn_in4"):  # [q | k | v | z | b | a]
        return [key_heads * key_dim] * 2 + [value_heads * value_dim] * 2 + [value_heads] * 2
    if p.kind == "gdn_conv":  # [q | k | v]
        return [key_heads * key_dim] * 2 + [value_heads * value_dim]
    return None


def _to_full_megatron(p: _Param, hf: Mapping[str, torch.Tensor], arch: Arch) -> torch.Tensor:
    if p.kind == "gdn_in":  # HF groups q, k, v, z (and b, a) per key head; Megatron holds each kind whole
        key_heads, value_heads, key_dim, value_dim = arch.linear_heads
        per = value_heads // key_heads
        qkvz, ba = (hf[n] for n in p.hf_names)
        q, k, v, z = qkvz.view(key_heads, -1, qkvz.shape[-1]).split([key_dim, key_dim, per * value_dim,
                                                                     per * value_dim], dim=1)
        b, a = ba.view(key_heads, -1, ba.shape[-1]).split([per, per], dim=1)
        return torch.cat([t.reshape(-1, qkvz.shape[-1]) for t in (q, k, v, z, b, a)])
    if p.kind in ("fc1", "gdn_in4"):
        return torch.cat([hf[n] for n in p.hf_names], dim=0)
    if p.kind == "qkvg":  # HF's q_proj holds each head's query then its output gate
        q, k, v = (hf[n] for n in p.hf_names)
        q, gate = q.view(arch.heads, 2, arch.head_dim, -1).unbind(1)
        per_group = [t.reshape(arch.groups, -1, t.shape[-1]) for t in (q, gate, k, v)]
        return torch.cat(per_group, dim=1).reshape(-1, q.shape[-1])
    if p.kind == "qkv":
        q, k, v = (hf[n] for n in p.hf_names)
        rest = q.shape[1:]
        per_group = [q.reshape(arch.groups, -1, *rest), k.reshape(arch.groups, -1, *rest),
                     v.reshape(arch.groups, -1, *rest)]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)
    return hf[p.hf_names[0]]


def from_full_megatron(p: _Param, full: torch.Tensor, arch: Arch) -> list[tuple[str, torch.Tensor]]:
    if p.kind == "gdn_in":
        key_heads, value_heads, key_dim, value_dim = arch.linear_heads
        q, k, v, z, b, a = (t.reshape(key_heads, -1, full.shape[-1])
                            for t in full.split(_sections(p, arch, full.shape[0]), dim=0))
        return list(zip(p.hf_names, (torch.cat([q, k, v, z], dim=1).reshape(-1, full.shape[-1]),
                                     torch.cat([b, a], dim=1).reshape(-1, full.shape[-1]))))
    if p.kind == "gdn_in4":
        q, k, v, z, b, a = full.split(_sections(p, arch, full.shape[0]), dim=0)
        return list(zip(p.hf_names, (torch.cat([q, k, v]), z, b, a)))
    if p.kind == "qkvg":
        q_per_group = arch.heads // arch.groups * arch.head_dim
        q, gate, k, v = full.reshape(arch.groups, -1, full.shape[-1]).split(
            [q_per_group, q_per_group, arch.head_dim, arch.head_dim], dim=1)
        q = torch.stack([q.reshape(arch.heads, arch.head_dim, -1), gate.reshape(arch.heads, arch.head_dim, -1)], 1)
        return list(zip(p.hf_names, (q.reshape(-1, full.shape[-1]), k.reshape(-1, full.shape[-1]),
                                     v.reshape(-1, full.shape[-1]))))
    if p.kind == "qkv":
        rest = full.shape[1:]
        q_per_group = arch.heads // arch.groups * arch.head_dim
        q, k, v = full.reshape(arch.groups, -1, *rest).split([q_per_group, arch.head_dim, arch.head_dim], dim=1)
        return [(n, t.reshape(-1, *rest)) for n, t in zip(p.hf_names, (q, k, v))]
    if p.kind == "fc1":
        return list(zip(p.hf_names, full.chunk(2, dim=0)))
    return [(p.hf_names[0], full)]


def _tp_split(p: _Param, full: torch.Tensor, tp_rank: int, tp_size: int, arch: Arch) -> torch.Tensor:
    if p.split_dim is None or tp_size == 1:
        return full
    sections = _sections(p, arch, full.shape[0])
    if sections:
        return torch.cat([block.chunk(tp_size, dim=0)[tp_rank] for block in full.split(sections, dim=0)], dim=0)
    return full.chunk(tp_size, dim=p.split_dim)[tp_rank]


def tp_merge(p: _Param, shards: list[torch.Tensor], arch: Arch) -> torch.Tensor:
    if p.split_dim is None or len(shards) == 1:
        return shards[0]
    sections = _sections(p, arch, shards[0].shape[0] * len(shards))
    if sections:
        pieces = [s.split([n // len(shards) for n in sections], dim=0) for s in shards]
        return torch.cat([piece[i] for i in range(len(sections)) for piece in pieces], dim=0)
    return torch.cat(shards, dim=p.split_dim)


# ---- state dicts ----

def _layer_range(arch: Arch, pp_rank: int, pp_size: int) -> tuple[int, int]:
    if arch.num_layers % pp_size:
        raise ValueError(f"{arch.num_layers} layers do not split evenly over {pp_size} pipeline stages")
    per_stage = arch.num_layers // pp_size
    return pp_rank * per_stage, per_stage


def hf_to_chunk(hf: Mapping[str, torch.Tensor], arch: Arch, tp_rank: int, tp_size: int, layer_offset: int,
                 num_local_layers: int, pre_process: bool, post_process: bool, ep_rank: int = 0,
                 ep_size: int = 1, etp: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """`etp`: (rank, size) of expert tensor parallel where it differs from tensor parallel (Megatron's MoE parallel
    folding, slime's --expert-tensor-parallel-size 1 beside a larger TP): the routed experts split over it."""
    out = {}
    local_experts = arch.num_experts // ep_size
    for name in _chunk_param_names(arch, num_local_layers, pre_process, post_process, layer_offset, local_experts):
        p = param_for(name, arch, layer_offset, ep_rank * local_experts)
        if p is None:  # last stage's copy of the tied embedding
            p = _Param("copy", (f"{arch.prefix}embed_tokens.weight",), 0)
        rank, size = etp if etp is not None and is_routed_expert(name) else (tp_rank, tp_size)
        out[name] = _tp_split(p, _to_full_megatron(p, hf, arch), rank, size, arch)
    return out


def is_routed_expert(name: str) -> bool:
    """A routed expert's parameter (split over expert tensor parallel), not a shared expert's or the router's."""
    return ".local_experts." in name


def hf_to_megatron_state_dict(hf_state_dict: Mapping[str, torch.Tensor], hf_config, tp_rank: int = 0,
                              tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0,
                              ep_size: int = 1, mtp_layers: int = 0) -> dict[str, torch.Tensor]:
    """The Megatron parameters (local-spec names, no `_extra_state`) of one rank's model chunk.

    Layers are split evenly over the `pp_size` stages, MoE experts evenly over the `ep_size` expert-parallel
    ranks; the last stage holds `mtp_layers` MTP layers. Tensors keep the HF dtype and may be views of the
    inputs. `hf_state_dict` only needs `__getitem__` (a lazy safetensors reader works).
    """
    arch = Arch.from_hf(hf_config, mtp_layers)
    offset, n_local = _layer_range(arch, pp_rank, pp_size)
    return hf_to_chunk(hf_state_dict, arch, tp_rank, tp_size, offset, n_local, pp_rank == 0, pp_rank == pp_size - 1,
                        ep_rank, ep_size)


def megatron_to_hf_state_dict(megatron_state_dicts: list[Mapping[str, torch.Tensor]], hf_config, pp_rank: int = 0,
                              pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1,
                              mtp_layers: int = 0) -> dict[str, torch.Tensor]:
    """Full HF tensors of one pipeline stage from its TP shards (`megatron_state_dicts[r]` = TP rank r's chunk)
    on expert-parallel rank `ep_rank` (its experts; everything else is the same on every EP rank).

    Inverse of `hf_to_megatron_state_dict`: the union over stages (and EP ranks) is the HF state dict, bit for
    bit (`lm_head.weight` is absent for tied embeddings, as in HF checkpoints). `_extra_state` keys are ignored.
    """
    arch = Arch.from_hf(hf_config, mtp_layers)
    offset, _ = _layer_range(arch, pp_rank, pp_size)
    expert_offset = ep_rank * (arch.num_experts // ep_size)
    out = {}
    for name in megatron_state_dicts[0]:
        if name.endswith("_extra_state"):
            continue
        p = param_for(name, arch, offset, expert_offset)
        if p is not None:
            out.update(from_full_megatron(p, tp_merge(p, [sd[name] for sd in megatron_state_dicts], arch), arch))
    return out
