"""The Megatron architecture of an HF config: which model families vime's Megatron model reproduces, and the
Megatron-LM flag values (argparse dest names) each config gives.

Families: Qwen2 / Qwen2.5, Qwen3, Llama (3.x RoPE scaling too), Qwen3-MoE, DeepSeek-V3 (multi-latent attention,
MoE with shared experts, sigmoid routing with the expert bias, group-limited routing), GLM-4.5 (`glm4_moe`: the
same router and shared experts as DeepSeek-V3 on grouped-query attention with qkv biases, partial rotary and
optional QK-norm). A config key vime cannot reproduce is refused here, naming the key and what is supported, before
any process starts.

Pure functions of the config; `arguments.fill_architecture_from_hf` applies them to parsed flags.
"""

from __future__ import annotations

from typing import Any

from vime.utils.mtp_config import declared_mtp_layers

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next",
                         "qwen3_5_text", "qwen3_5_moe_text")
MOE_MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe_text")
# Gated DeltaNet layers among gated full-attention ones: Qwen3-Next, and Qwen3.5's language model (its linear
# attention's input projection stored as four matrices instead of Qwen3-Next's two interleaved ones)
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
SOFTMAX_MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")
# families whose attention has biases on q, k and v only (no output-projection bias, which Megatron's GPT has not)
QKV_BIAS_MODEL_TYPES = ("qwen2", "glm4_moe")
MLA_MODEL_TYPES = ("deepseek_v3",)
# RoPE variants (HF's rope_parameters / rope_scaling "rope_type") whose frequencies vime reproduces bit for bit
ROPE_TYPES = ("default", "llama3", "linear")
_ROPE_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings")}
MLA_ROPE_TYPES = ("default", "yarn")  # Megatron's MLA has plain RoPE and YaRN (DeepSeek-V3's published config)
_NO_MOE = {"num_experts": None, "moe_router_topk": None, "moe_ffn_hidden_size": None, "moe_layer_freq": None,
           "moe_router_pre_softmax": None, "moe_router_score_function": None, "moe_router_enable_expert_bias": None,
           "moe_router_num_groups": None, "moe_router_group_topk": None, "moe_router_topk_scaling_factor": None,
           "moe_shared_expert_intermediate_size": None}
_NO_MLA = {"multi_latent_attention": None, "q_lora_rank": None, "kv_lora_rank": None, "qk_head_dim": None,
           "qk_pos_emb_head_dim": None, "v_head_dim": None}
_NO_LINEAR = {"linear_attention_freq": None, "experimental_attention_variant": None, "linear_conv_kernel_dim": None,
              "linear_key_head_dim": None, "linear_value_head_dim": None, "linear_num_key_heads": None,
              "linear_num_value_heads": None, "attention_output_gate": None, "layernorm_zero_centered_gamma": None,
              "moe_shared_expert_gate": None}


# checkpoints whose language model sits inside a multimodal wrapper: its config is `text_config`, its tensors are
# under `model.language_model.` (the vision tower's, `model.visual.`, are not the trainer's)
MULTIMODAL_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def language_config(hf_config):
    """The config of the language model vime trains: `text_config` of a multimodal wrapper, else the config."""
    if getattr(hf_config, "model_type", None) in MULTIMODAL_WRAPPERS:
        return hf_config.text_config
    return hf_config


def hf_moe(hf_config) -> dict[str, Any]:
    """The MoE architecture of an HF config: experts, top-k, expert size, which layers are MoE (a 0/1 list), the
    router's scoring and the shared experts. Dense configs give None everywhere."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in SOFTMAX_MOE_MODEL_TYPES and (getattr(hf_config, "num_experts", 0) or 0):
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf_config.num_hidden_layers)]
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0  # Qwen3-Next: one, gated
        return {**_NO_MOE, "num_experts": hf_config.num_experts, "moe_router_topk": hf_config.num_experts_per_tok,
                "moe_ffn_hidden_size": hf_config.moe_intermediate_size, "moe_layer_freq": pattern,
                # norm_topk_prob: softmax over the chosen k; else softmax over all experts, then the top k
                # (Qwen3.5-MoE always renormalises the chosen k, and its config has no such key)
                "moe_router_pre_softmax": not getattr(hf_config, "norm_topk_prob", model_type == "qwen3_5_moe_text"),
                "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
                "moe_shared_expert_intermediate_size": shared or None}
    if model_type in ("deepseek_v3", "glm4_moe"):
        return _sigmoid_moe(hf_config, model_type)
    return dict(_NO_MOE)


def _sigmoid_moe(c, model_type: str) -> dict[str, Any]:
    """DeepSeek-V3's router, which GLM-4.5 shares: sigmoid scores, the expert bias (`e_score_correction_bias`)
    choosing the experts but not weighting them, the top-k weights normalised then scaled by
    `routed_scaling_factor`, experts picked from the `topk_group` best of `n_group` groups (a group's score: the sum
    of its two best experts); the first `first_k_dense_replace` layers dense; shared experts beside the routed."""
    for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        value = getattr(c, key, supported)
        if value != supported:
            raise ValueError(f"HF config {key} {value!r} is not supported for {model_type}; supported: {supported!r}")
    topk, experts = c.num_experts_per_tok, c.n_routed_experts
    if topk > 1 and not getattr(c, "norm_topk_prob", True):
        raise ValueError(f"HF config norm_topk_prob=False is not supported for {model_type} (Megatron normalises "
                         "the top-k sigmoid scores); supported: True")
    groups, group_topk = getattr(c, "n_group", 1) or 1, getattr(c, "topk_group", 1) or 1
    if experts % groups:
        raise ValueError(f"HF config n_group {groups} does not divide n_routed_experts {experts}")
    if groups > 1 and topk != 2 * group_topk:  # Megatron scores a group by its top (topk / topk_group) experts
        raise ValueError(f"HF config num_experts_per_tok {topk} with topk_group {group_topk}: group-limited routing "
                         "scores each group by its two best experts, which Megatron reproduces only when "
                         "num_experts_per_tok = 2 x topk_group (DeepSeek-V3: 8 and 4), or with n_group 1")
    first_dense, freq = getattr(c, "first_k_dense_replace", 0) or 0, getattr(c, "moe_layer_freq", 1) or 1
    shared = getattr(c, "n_shared_experts", 0) or 0
    return {**_NO_MOE, "num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": c.moe_intermediate_size,
            "moe_layer_freq": [int(i >= first_dense and i % freq == 0) for i in range(c.num_hidden_layers)],
            "moe_router_pre_softmax": False, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": group_topk if groups > 1 else None,
            "moe_router_topk_scaling_factor": float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
            "moe_shared_expert_intermediate_size": shared * c.moe_intermediate_size if shared else None}


def hf_mla(hf_config) -> dict[str, Any]:
    """Multi-latent attention (DeepSeek-V3): queries through an optional low-rank `q_lora_rank`, keys and values
    from one `kv_lora_rank` latent, each head's query/key split into a no-position part (`qk_nope_head_dim`) and a
    decoupled rotary part (`qk_rope_head_dim`, one key shared by all heads). None everywhere for other models."""
    if getattr(hf_config, "model_type", None) not in MLA_MODEL_TYPES:
        return dict(_NO_MLA)
    if not getattr(hf_config, "rope_interleave", True):
        raise ValueError("HF config rope_interleave=False is not supported for deepseek_v3 (Megatron's and vLLM's "
                         "MLA rotate interleaved pairs, as DeepSeek's checkpoints are laid out); supported: True")
    return {"multi_latent_attention": True, "q_lora_rank": hf_config.q_lora_rank,
            "kv_lora_rank": hf_config.kv_lora_rank, "qk_head_dim": hf_config.qk_nope_head_dim,
            "qk_pos_emb_head_dim": hf_config.qk_rope_head_dim, "v_head_dim": hf_config.v_head_dim}


def hf_linear_attention(hf_config) -> dict[str, Any]:
    """Qwen3-Next's hybrid layers: which layers are Gated DeltaNet (`layer_types`, as Megatron's
    `linear_attention_freq` list: 1 = linear attention), their sizes, the sigmoid output gate of the full-attention
    layers (`attention_output_gate`), norms that scale by 1 + weight (`layernorm_zero_centered_gamma`) and the
    shared expert's sigmoid gate. None everywhere for other models (vime/trainer/megatron/linear_attention.py)."""
    if getattr(hf_config, "model_type", None) not in HYBRID_MODEL_TYPES:
        return dict(_NO_LINEAR)
    types = list(hf_config.layer_types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != hf_config.num_hidden_layers:
        raise ValueError(f"HF config layer_types {unknown or types!r} is not supported: one of {LAYER_TYPES} per "
                         f"layer ({hf_config.num_hidden_layers})")
    key_heads, value_heads = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    if value_heads % key_heads:
        raise ValueError(f"HF config linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads "
                         f"{key_heads}")
    return {"linear_attention_freq": [int(t == "linear_attention") for t in types],
            "experimental_attention_variant": "gated_delta_net",
            "linear_conv_kernel_dim": hf_config.linear_conv_kernel_dim,
            "linear_key_head_dim": hf_config.linear_key_head_dim,
            "linear_value_head_dim": hf_config.linear_value_head_dim,
            "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
            "attention_output_gate": True, "layernorm_zero_centered_gamma": True,
            "moe_shared_expert_gate": bool(getattr(hf_config, "shared_expert_intermediate_size", 0)
                                           and getattr(hf_config, "num_experts", 0)) or None}


def hf_rope(hf_config) -> tuple[float, dict | None]:
    """(theta, scaling) of an HF config's RoPE. `scaling` is None for plain RoPE, else {"rope_type", and the
    type's parameters}: "llama3" (factor, low/high_freq_factor, original_max_position_embeddings) or "linear"
    (factor); for multi-latent attention "yarn" (factor, original_max_position_embeddings, beta_fast/slow,
    mscale, mscale_all_dim). Any other type is refused, naming the key and the supported set."""
    key = "rope_parameters" if getattr(hf_config, "rope_parameters", None) else "rope_scaling"
    rope = dict(getattr(hf_config, key, None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    mla = getattr(hf_config, "model_type", None) in MLA_MODEL_TYPES
    supported = MLA_ROPE_TYPES if mla else ROPE_TYPES
    if rope_type not in supported:
        raise ValueError(f"HF config {key}.rope_type {rope_type!r} is not supported; supported: {supported}"
                         + (" (multi-latent attention)" if mla else ""))
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("HF config has no rope theta (rope_parameters.rope_theta or rope_theta)")
    if rope_type == "default":
        return float(theta), None
    missing = [k for k in _ROPE_KEYS[rope_type] if rope.get(k) is None]
    if missing:
        raise ValueError(f"HF config {key} of rope_type {rope_type!r} lacks {missing}")
    scaling = {"rope_type": rope_type, **{k: float(rope[k]) for k in _ROPE_KEYS[rope_type]}}
    if rope_type == "yarn":
        scaling.update(_yarn(rope, key))
    return float(theta), scaling


def _yarn(rope: dict, key: str) -> dict:
    """YaRN's optional parameters, as transformers reads them: the cos/sin scale is mscale's over
    mscale_all_dim's when both are given, else that of mscale 1; the softmax scale takes mscale_all_dim's."""
    for name, default in (("attention_factor", None), ("truncate", True)):
        if rope.get(name, default) != default:
            raise ValueError(f"HF config {key}.{name} {rope[name]!r} is not supported for YaRN; supported: {default!r}")
    both = bool(rope.get("mscale") and rope.get("mscale_all_dim"))
    return {"beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
            "mscale": float(rope["mscale"]) if both else 1.0,
            "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}


def hf_architecture(hf_config) -> dict[str, Any]:
    """Megatron architecture values (dest name -> value) for an HF config of a supported family.

    Raises ValueError for model types or features vime's Megatron model does not implement.
    """
    hf_config = language_config(hf_config)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"HF model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"HF config hidden_act {hf_config.hidden_act!r} is not supported (only silu / SwiGLU)")
    # Qwen3 and Llama's attention_bias also adds an output-projection bias, which Megatron's GPT has not.
    if model_type not in QKV_BIAS_MODEL_TYPES and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"HF config attention_bias=True is not supported for {model_type} (it adds an output-"
                         f"projection bias); supported: False")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("HF config mlp_bias=True is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("HF config use_sliding_window=True is not supported")
    heads = hf_config.num_attention_heads
    theta, rope_scaling = hf_rope(hf_config)
    llama3 = rope_scaling is not None and rope_scaling["rope_type"] == "llama3"
    mla = hf_mla(hf_config)
    head_dim = mla["v_head_dim"] or getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return {
        "num_layers": hf_config.num_hidden_layers,
        "mtp_embeds_first_position": model_type in MTP_UNDER_MTP,
        "hidden_size": hf_config.hidden_size,
        # an MoE model without dense layers (Qwen3.5-MoE) has no intermediate_size: Megatron still wants one
        "ffn_hidden_size": getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size,
        "num_attention_heads": heads,
        "num_query_groups": getattr(hf_config, "num_key_value_heads", None) or heads,
        # MLA: Megatron-LM's DeepSeek recipes give the value head size (the attention output per head)
        "kv_channels": head_dim,
        "rotary_base": theta,
        "rotary_percent": 1.0 if mla["multi_latent_attention"] else hf_rotary_percent(hf_config, head_dim),
        "rope_scaling": rope_scaling,  # no flag: the frequencies are computed from the config's own values
        "use_rope_scaling": llama3,
        "rope_scaling_factor": rope_scaling["factor"] if llama3 else None,
        "norm_epsilon": float(hf_config.rms_norm_eps),
        "vocab_size": hf_config.vocab_size,
        "untie_embeddings_and_output_weights": not getattr(hf_config, "tie_word_embeddings", False),
        "max_position_embeddings": hf_config.max_position_embeddings,
        # Qwen3's per-head q/k norms (GLM-4.5's where use_qk_norm); MLA's norms of the query and key/value latents
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe", *HYBRID_MODEL_TYPES) or bool(mla["multi_latent_attention"])
        or (model_type == "glm4_moe" and bool(getattr(hf_config, "use_qk_norm", False))),
        **hf_moe(hf_config),
        **mla,
        **hf_linear_attention(hf_config),
        "add_qkv_bias": model_type == "qwen2" or (model_type in QKV_BIAS_MODEL_TYPES
                                                  and bool(getattr(hf_config, "attention_bias", False))),
    }


def hf_rotary_percent(hf_config, head_dim: int) -> float:
    """The share of each head's dimensions that RoPE rotates (`partial_rotary_factor`, GLM-4.5's 0.5): the first
    `head_dim x factor` dimensions, rotated in halves as transformers does, the rest passed through (Megatron's
    `rotary_percent`, which rotates the same dimensions the same way)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    factor = 1.0 if factor is None else float(factor)
    rotary = head_dim * factor
    if not 0.0 < factor <= 1.0 or rotary != int(rotary) or int(rotary) % 2:
        raise ValueError(f"HF config partial_rotary_factor {factor!r} with head_dim {head_dim}: the rotary part must "
                         "be an even number of dimensions; supported: a factor in (0, 1] giving one")
    return factor


# HF model types (of the language model) whose checkpoints hold MTP layers vime reads: after the decoder's layers
# (`model.layers.{num_hidden_layers + k}`: DeepSeek-V3, GLM-4.5), or under `mtp.` (`MTP_UNDER_MTP`)
MTP_FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Qwen3-Next's and Qwen3.5's layout: mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.{k}.*,
# mtp.norm; their drafter reads the next token's embedding at position 0 too (DeepSeek's zeroes it)
MTP_UNDER_MTP = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def multi_token_prediction_layers(hf_config) -> int:
    """How many multi-token-prediction layers the checkpoint stores (`vime.utils.mtp_config`); the trainer holds
    as many of them as --mtp-num-layers asks (`multi_token_prediction`)."""
    text = language_config(hf_config)
    return declared_mtp_layers(vars(text), text.model_type)
