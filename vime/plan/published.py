"""Published model configs, written from the numbers in their config.json files (no download), each at a layout
a user would train it with, and the planner's table of them (docs/guides/memory_plan.md).

    python -m vime.plan.published   # prints the table
"""

from __future__ import annotations

from dataclasses import replace

from vime.plan.memory import GIB, EngineLayout, TrainerLayout, engine_memory, trainer_memory
from vime.trainer.flops import FlopShape

QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "rope_theta": 1000000.0}
PUBLISHED = {  # HF config fields as published
    "Qwen3-0.6B": {**QWEN3, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "intermediate_size": 3072, "tie_word_embeddings": True},
    "Qwen3-1.7B": {**QWEN3, "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "intermediate_size": 6144, "tie_word_embeddings": True},
    "Qwen3-4B": {**QWEN3, "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 9728, "tie_word_embeddings": True},
    "Qwen3-8B": {**QWEN3, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 12288, "tie_word_embeddings": False},
    "Qwen3-32B": {**QWEN3, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "intermediate_size": 25600, "tie_word_embeddings": False},
    "Qwen3-30B-A3B": {**QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                      "tie_word_embeddings": False},
    "Llama-3.1-8B": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                     "rope_theta": 500000.0, "tie_word_embeddings": False},
    "DeepSeek-V3": {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536,
                    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
                    "topk_method": "noaux_tc", "norm_topk_prob": True, "tie_word_embeddings": False},
    "GLM-4.5-Air": {"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "num_hidden_layers": 46,
                    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
                    "attention_bias": True, "use_qk_norm": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
                    "max_position_embeddings": 131072, "num_nextn_predict_layers": 1, "tie_word_embeddings": False},
    "Qwen3-Next-80B-A3B": {"model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
                           "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                           "head_dim": 256, "intermediate_size": 5120, "moe_intermediate_size": 512,
                           "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
                           "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                           "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
                           "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rms_norm_eps": 1e-06,
                           "max_position_embeddings": 262144, "router_aux_loss_coef": 0.001,
                           "tie_word_embeddings": False},
    # natively multimodal: the language model is `text_config` (transformers' Qwen3.5-35B-A3B configuration), the
    # vision tower transformers' default for the family
    "Qwen3.5-35B-A3B": {"model_type": "qwen3_5_moe", "tie_word_embeddings": False, "text_config": {
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
        "num_experts_per_tok": 8, "full_attention_interval": 4, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "partial_rotary_factor": 0.25, "max_position_embeddings": 262144}},
    # dense, natively multimodal: 48 Gated DeltaNet + 16 gated full-attention layers; a vision tower of the family's
    # shape projecting into 5120
    "Qwen3.5-27B": {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": {
        "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "attn_output_gate": True, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "partial_rotary_factor": 0.25, "rope_theta": 10000000.0,
        "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "num_position_embeddings": 2304, "out_hidden_size": 5120}},
}

# (GPUs, trainer layout) of each: bf16, samples of 1k prompt + 3k response tokens, groups of 8
SAMPLE = {"micro_batch_tokens": 4096, "logit_rows": 3072}
LAYOUTS = {
    "Qwen3-0.6B": (8, TrainerLayout(dp=8, **{**SAMPLE, "micro_batch_tokens": 4 * 4096, "logit_rows": 4 * 3072})),
    "Qwen3-1.7B": (8, TrainerLayout(dp=8, **{**SAMPLE, "micro_batch_tokens": 2 * 4096, "logit_rows": 2 * 3072})),
    "Qwen3-4B": (8, TrainerLayout(dp=8, distributed_optimizer=True, **SAMPLE)),
    "Qwen3-8B": (8, TrainerLayout(tp=2, dp=4, distributed_optimizer=True, **SAMPLE)),
    "Qwen3-32B": (16, TrainerLayout(tp=8, pp=2, dp=1, sequence_parallel=True, distributed_optimizer=True,
                                    recompute="full", micro_batches=8, **SAMPLE)),
    "Qwen3-30B-A3B": (16, TrainerLayout(tp=1, dp=16, ep=8, distributed_optimizer=True, recompute="full", **SAMPLE)),
    "Llama-3.1-8B": (8, TrainerLayout(tp=2, dp=4, distributed_optimizer=True, **SAMPLE)),
    "DeepSeek-V3": (256, TrainerLayout(tp=8, pp=16, dp=2, ep=16, etp=1, sequence_parallel=True,
                                       distributed_optimizer=True, recompute="full", micro_batches=16, **SAMPLE)),
    "GLM-4.5-Air": (32, TrainerLayout(tp=1, pp=4, dp=8, ep=8, distributed_optimizer=True, recompute="full", **SAMPLE)),
}
ENGINE_TP = {"Qwen3-32B": 2, "Qwen3-30B-A3B": 2, "DeepSeek-V3": 32, "GLM-4.5-Air": 4}
GPU_GIB = 80.0


def hf_config(name: str):
    """The transformers config of a published model (its class from `model_type`)."""
    from transformers import AutoConfig

    fields = dict(PUBLISHED[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def table(gpu_gib: float = GPU_GIB) -> str:
    """Markdown: each published model at its layout, the trainer rank's parts and peak, and an engine's KV cache."""
    rows = ["| model | GPUs | trainer layout | weights | grads | Adam | activations | logits | trainer peak | "
            "fits | engine TP: weights, KV tokens |", "|" + "---|" * 11]
    for name, (gpus, layout) in LAYOUTS.items():
        config = hf_config(name)
        shape = FlopShape.from_hf(config)
        tied = bool(config.tie_word_embeddings)
        memory = trainer_memory(shape, layout, tied)
        p = {k: v / GIB for k, v in memory.parts.items()}
        engine_tp = ENGINE_TP.get(name, 1)
        engine = engine_memory(shape, replace(EngineLayout(), tp=engine_tp), gpu_gib * GIB, tied)
        what = f"TP{layout.tp} PP{layout.pp} DP{layout.dp}" + (f" EP{layout.ep}" if layout.ep > 1 else "") + \
            (" SP" if layout.sequence_parallel else "") + (" dist-opt" if layout.distributed_optimizer else "") + \
            (" recompute" if layout.recompute == "full" else "") + \
            f", {layout.micro_batch_tokens // 4096} x 4k tokens"
        fits = memory.peak_bytes <= gpu_gib * GIB
        rows.append(f"| {name} | {gpus} | {what} | {p['weights']:.1f} | {p['gradients']:.1f} | {p['optimizer']:.1f} "
                    f"| {p['activations']:.1f} | {p['logits']:.1f} | {memory.peak_bytes / GIB:.1f} | "
                    f"{'yes' if fits else 'no'} | TP{engine_tp}: {engine['weights'] / GIB:.1f} GiB, "
                    f"{engine['kv_cache_tokens'] / 1000:,.0f}k |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
