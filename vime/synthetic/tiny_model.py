"""Build a tiny Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Llama / Llama 3.x / DeepSeek-V3 / GLM-4.5 / Qwen3-Next /
Qwen3.5 (language model, dense or MoE) model with a locally trained tokenizer, or a tiny Qwen2.5-VL / Qwen3-VL with
its processor (`tiny_vlm`). No downloads.

    python -m vime.synthetic.tiny_model --arch qwen3 --out /tmp/tiny-qwen3

The result is a normal HF checkpoint directory (config.json, model.safetensors, tokenizer files with a
chat template) that vLLM, transformers and vime's Megatron loader all read. Deterministic from --seed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vime.synthetic.tiny_tokenizer import build_tokenizer
from vime.synthetic.tiny_vlm import VLM_ARCHS, build_tiny_vlm

ARCHS = ("qwen2", "qwen2_5", "qwen3", "qwen3_moe", "llama", "llama3", "deepseek_v3", "glm4_moe", "qwen3_next",
         "qwen3_5", "qwen3_5_moe")
# Llama 3.1's RoPE, as its config.json publishes it (3.2 and 3.3 differ only in the factor)
LLAMA3_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}
# DeepSeek-V3's YaRN, as its config.json publishes it (with max_position_embeddings 163840)
DEEPSEEK_V3_ROPE_SCALING = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"}

def build_config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int, max_position_embeddings: int, tie_word_embeddings: bool, eos_id: int,
                 pad_id: int):
    from transformers import (DeepseekV3Config, Glm4MoeConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig,
                              Qwen3NextConfig)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen2_5":  # Qwen2.5's shapes: qkv biases, theta 1e6 (the small ones tie their embeddings)
        return Qwen2Config(rope_theta=1000000.0, **common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden_size // num_heads, **common)
    if arch == "qwen3_moe":  # 4 experts, top-2 with norm_topk_prob; the first layer dense (mlp_only_layers)
        return Qwen3MoeConfig(head_dim=hidden_size // num_heads, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=intermediate_size // 2, norm_topk_prob=True,
                              mlp_only_layers=[0] if num_layers > 1 else [], decoder_sparse_step=1, **common)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama3":  # Llama 3.1: theta 5e5 with its rope_scaling block and 128k positions
        return LlamaConfig(rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE_SCALING),
                           **{**common, "max_position_embeddings": max(max_position_embeddings, 131072)})
    if arch == "deepseek_v3":
        return DeepseekV3Config(**_deepseek_v3_shape(hidden_size, num_heads, intermediate_size),
                                rope_scaling=dict(DEEPSEEK_V3_ROPE_SCALING),
                                **{**common, "num_key_value_heads": num_heads, "max_position_embeddings": 163840})
    if arch == "glm4_moe":
        return Glm4MoeConfig(**_glm4_moe_shape(hidden_size, num_heads, intermediate_size), **common)
    if arch == "qwen3_next":
        return Qwen3NextConfig(**_qwen3_next_shape(hidden_size, num_heads, intermediate_size, num_layers),
                               **{**common, "num_hidden_layers": max(num_layers, 4)})
    if arch in ("qwen3_5", "qwen3_5_moe"):  # the language model of Qwen3.5 (dense, as 27B) / Qwen3.5-MoE
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        shape = _qwen3_next_shape(hidden_size, num_heads, intermediate_size, num_layers)
        for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "num_nextn_predict_layers"):
            shape.pop(key)  # Qwen3.5-MoE: every layer MoE, the chosen experts' weights always renormalised
        if arch == "qwen3_5":
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "shared_expert_intermediate_size"):
                shape.pop(key)
        config_class = Qwen3_5TextConfig if arch == "qwen3_5" else Qwen3_5MoeTextConfig
        return config_class(**shape, **{**common, "num_hidden_layers": max(num_layers, 4)})
    raise ValueError(f"--arch must be one of {ARCHS}, got {arch!r}")


def _qwen3_next_shape(hidden_size: int, num_heads: int, intermediate_size: int, num_layers: int) -> dict:
    """Qwen3-Next's structure, shrunk: three Gated DeltaNet layers, then one gated full-attention layer (at least 4
    layers), RoPE on a quarter of each head, norms scaling by 1 + weight; 4 routed experts, top-2 softmax routing
    with norm_topk_prob, one shared expert behind its sigmoid gate; one multi-token-prediction layer declared.
    The linear-attention heads are 64 wide, keys as wide as values: vLLM's CPU Gated DeltaNet kernel takes 64 or
    128 and equal sizes only (and bfloat16 only)."""
    layers = max(num_layers, 4)
    return dict(head_dim=hidden_size // num_heads, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 4,
                shared_expert_intermediate_size=intermediate_size // 4, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], num_nextn_predict_layers=1)


def _glm4_moe_shape(hidden_size: int, num_heads: int, intermediate_size: int) -> dict:
    """GLM-4.5's structure, shrunk: grouped-query attention with q/k/v biases, RoPE on half of each head
    (partial_rotary_factor 0.5) and per-head QK-norm (GLM-4.5's; GLM-4.5-Air has none: config {"use_qk_norm":
    False}); 4 routed experts, top-2 by sigmoid scores with the expert bias, scaled by 2.5, one shared expert, the
    first layer dense; one multi-token-prediction layer declared (not stored, as transformers writes it)."""
    return dict(head_dim=hidden_size // num_heads, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                moe_intermediate_size=intermediate_size // 4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                first_k_dense_replace=1, num_nextn_predict_layers=1)


def _deepseek_v3_shape(hidden_size: int, num_heads: int, intermediate_size: int) -> dict:
    """DeepSeek-V3's structure, shrunk: multi-latent attention with a low-rank query, 4 routed experts in 2
    groups (top-2 from the best group, sigmoid scores with the expert bias, scaled by 2.5), a shared expert, the
    first layer dense, one multi-token-prediction layer declared (not stored, as transformers writes it), YaRN
    RoPE as DeepSeek-V3 publishes it. The
    key/value latent and the rotary head keep DeepSeek-V3's sizes (512 + 64): vLLM's CPU MLA kernel is built for
    that latent size only."""
    return dict(q_lora_rank=hidden_size // 2, kv_lora_rank=512, qk_rope_head_dim=64,
                qk_nope_head_dim=hidden_size // num_heads, v_head_dim=hidden_size // num_heads,
                moe_intermediate_size=intermediate_size // 4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                first_k_dense_replace=1, num_nextn_predict_layers=1, rope_interleave=True,
                # DeepSeek-V3's config.json states its router; transformers assumes it, vLLM reads it
                scoring_func="sigmoid", topk_method="noaux_tc")


def build_tiny_model(
    out: str | os.PathLike,
    arch: str = "qwen3",
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    config: dict | None = None,
    with_mtp: bool = False,
) -> Path:
    """Write a randomly initialised (seeded) HF checkpoint with tokenizer to `out`; returns the path.

    `config`: HF config keys to set over the family's tiny defaults, each one the family's config has, e.g. the
    layer layout of an MoE: {"moe_intermediate_size": 80} (experts narrower than the dense layers), {"mlp_only_layers":
    [], "decoder_sparse_step": 2} (Qwen3-MoE: every second layer MoE), {"first_k_dense_replace": 2,
    "n_shared_experts": 2} (DeepSeek-V3)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size, seed)
    # The trained vocabulary can be a little smaller than asked; the embedding keeps the asked size.
    hf_config = build_config(
        arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
        max_position_embeddings, tie_word_embeddings, tokenizer.eos_token_id, tokenizer.pad_token_id,
    )
    for key, value in (config or {}).items():
        if not hasattr(hf_config, key):
            raise ValueError(f"config key {key!r} is not a {type(hf_config).__name__} field")
        setattr(hf_config, key, value)
    if with_mtp:
        from vime.trainer.megatron.hf_architecture import MTP_FAMILIES, multi_token_prediction_layers

        if arch in ("qwen3_5", "qwen3_5_moe"):  # as Qwen3.5 declares its one MTP layer
            hf_config.mtp_num_hidden_layers = 1
        if hf_config.model_type not in MTP_FAMILIES or not multi_token_prediction_layers(hf_config):
            raise ValueError(f"--with-mtp: {arch} checkpoints hold no MTP layers vime writes "
                             f"({', '.join(MTP_FAMILIES)})")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():  # HF init leaves some tensors (norms, biases) at constants; perturb all for tests
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for name, b in model.named_buffers():  # DeepSeek-V3's / GLM-4.5's expert bias: enough to change the choice
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    published = {"llama3": LLAMA3_ROPE_SCALING, "deepseek_v3": DEEPSEEK_V3_ROPE_SCALING}.get(arch)
    if published:  # config.json as Meta / DeepSeek publish it (transformers would write rope_parameters instead)
        saved = json.loads((out / "config.json").read_text())
        rope = saved.pop("rope_parameters", None) or {}
        saved.update(rope_theta=rope["rope_theta"], rope_scaling=dict(published))
        (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True))
    if with_mtp:
        _write_mtp_layers(out, hf_config, seed)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    (out / "vime_tiny_model.json").write_text(json.dumps({"arch": arch, "seed": seed, "config": config or {}}))
    return out


def _write_mtp_layers(out: Path, hf_config, seed: int) -> None:
    """Add the config's multi-token-prediction layers to the checkpoint as their families publish them
    (transformers writes none; `hf_mtp_names`): DeepSeek-V3's and GLM-4.5's layer num_hidden_layers + k holds a
    decoder layer shaped like the last one plus eh_proj, enorm, hnorm and shared_head.norm; Qwen3-Next's and
    Qwen3.5's `mtp.` block a full-attention layer shaped like the last one plus fc, pre_fc_norm_embedding,
    pre_fc_norm_hidden and norm (centred on 0: they scale by 1 + weight). Seeded values."""
    import torch
    from safetensors.torch import load_file, save_file

    from vime.trainer.megatron.hf_architecture import MTP_UNDER_MTP, multi_token_prediction_layers

    count = multi_token_prediction_layers(hf_config)
    path = out / "model.safetensors"
    tensors = load_file(path)
    n, h = hf_config.num_hidden_layers, hf_config.hidden_size
    generator = torch.Generator().manual_seed(seed + 1)
    under_mtp = hf_config.model_type in MTP_UNDER_MTP
    kinds = getattr(hf_config, "layer_types", None) or ["full_attention"] * n
    last = f"model.layers.{max(i for i, kind in enumerate(kinds) if kind == 'full_attention')}."
    for k in range(count):
        layer = f"mtp.layers.{k}." if under_mtp else f"model.layers.{n + k}."
        for name, value in list(tensors.items()):
            if name.startswith(last):
                tensors[layer + name[len(last):]] = value + torch.randn(value.shape, generator=generator) * 0.02
        own = "mtp." if under_mtp else layer
        projection = own + ("fc.weight" if under_mtp else "eh_proj.weight")
        tensors[projection] = torch.randn(h, 2 * h, generator=generator) * 0.05
        norms = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm") if under_mtp else (
            "enorm", "hnorm", "shared_head.norm")
        for norm in norms:
            tensors[f"{own}{norm}.weight"] = (0 if under_mtp else 1) + torch.randn(h, generator=generator) * 0.02
    save_file(tensors, path, metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS + VLM_ARCHS, default="qwen3",
                   help="Model family (default: qwen3); qwen2_5_vl and qwen3_vl: a vision-language model with its "
                        "processor (vime.synthetic.tiny_vlm).")
    p.add_argument("--out", required=True, help="Output directory for the HF checkpoint.")
    p.add_argument("--seed", type=int, default=0, help="Seed for tokenizer corpus and weights (default: 0).")
    p.add_argument("--vocab-size", type=int, default=512, help="Tokenizer/embedding size (default: 512).")
    p.add_argument("--hidden-size", type=int, default=128, help="Hidden size (default: 128; head_dim = hidden/heads must be >= 32 for vLLM CPU attention).")
    p.add_argument("--num-layers", type=int, default=2, help="Transformer layers (default: 2).")
    p.add_argument("--num-heads", type=int, default=4, help="Attention heads (default: 4).")
    p.add_argument("--num-kv-heads", type=int, default=2, help="Key/value heads, GQA (default: 2).")
    p.add_argument("--intermediate-size", type=int, default=256, help="MLP width (default: 256).")
    p.add_argument("--tie-word-embeddings", action="store_true", help="Share input and output embeddings.")
    p.add_argument("--with-mtp", action="store_true",
                   help="Store the multi-token-prediction layers the config declares, as their families publish "
                        "them (deepseek_v3, glm4_moe, qwen3_next, qwen3_5; transformers writes none).")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="An HF config key over the family's defaults, its value as JSON (repeatable), e.g. "
                        "--set moe_intermediate_size=80 --set decoder_sparse_step=2 --set 'mlp_only_layers=[]'.")
    a = p.parse_args(argv)
    overrides = {}
    for item in a.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item!r}: expected KEY=JSON")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError as e:
            p.error(f"--set {item!r}: the value is not JSON ({e}); quote strings as JSON does")
    vlm_options = overrides or a.tie_word_embeddings or a.with_mtp
    if a.arch in VLM_ARCHS and vlm_options:
        p.error(f"--arch {a.arch}: --set, --tie-word-embeddings and --with-mtp are for the text families")
    try:
        if a.arch in VLM_ARCHS:
            path = build_tiny_vlm(a.out, a.arch, a.seed, a.vocab_size, a.hidden_size, a.num_layers, a.num_heads,
                                  a.num_kv_heads, a.intermediate_size)
            print(f"wrote {a.arch} tiny model to {path}")
            return
        path = build_tiny_model(
            a.out, a.arch, a.seed, a.vocab_size, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads,
            a.intermediate_size, tie_word_embeddings=a.tie_word_embeddings, config=overrides, with_mtp=a.with_mtp,
        )
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {a.arch} tiny model to {path}")


if __name__ == "__main__":
    main()
