"""Build Megatron-core `GPTModel`s for Qwen2 / Qwen2.5 / Qwen3 / Llama (3.x RoPE scaling too) / Qwen3-MoE /
DeepSeek-V3 (multi-latent attention) / GLM-4.5 (partial rotary) checkpoints.

Who calls it: the Megatron trainer, after `parallel.init_parallel()` and
`arguments.fill_architecture_from_hf()`; the convert tools; the tests.

On CPU the model uses the local (pure PyTorch) layer spec with RMSNorm and torch's scaled-dot-product
attention (`attention.SDPAttention`), float32 parameters, CPU initialisation and no other fused kernels. On a GPU
with TransformerEngine installed it uses the TE spec (the norms are then fused into `linear_qkv` / `linear_fc1`,
see `hf_conversion`), and bf16/fp16 when asked.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from vime.config.train import MegatronConfig, RoutingReplayConfig
from vime.trainer.megatron.attention import SDPAttention
from vime.trainer.megatron.cpu_compat import redirect_backward_for_sequence_parallel
from vime.trainer.megatron.device import training_device
from vime.trainer.megatron.linear_attention import GatedDeltaNetAttention
from vime.trainer.megatron.megatron_flags import core_flag, given_fields, warn_once
from vime.trainer.megatron.multi_token_prediction import attach_mtp
from vime.trainer.megatron.packed_rope import use_packed_rope
from vime.utils.device import training_dtype, use_gpu


def use_transformer_engine() -> bool:
    """Whether to build TransformerEngine's layer spec: not yet, on any device, installed or not. That spec has never
    run in vime's trainer (its attention takes none of vime's shared-prompt plans or packed layouts, its fused norms
    load through untested names); the local spec (torch layers, vime's SDPA attention with the flash, memory-efficient
    and varlen kernels on GPU) is what every test and the GPU check run."""
    return False


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    """float32 on CPU whatever the flags (bf16 is several times slower there); bf16/fp16 on GPU when asked."""
    return getattr(torch, training_dtype(args))


def build_transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """TransformerConfig from filled Megatron args (see `arguments.fill_architecture_from_hf`).

    TP/PP sizes are taken from args and must match `parallel_state`.
    """
    megatron = MegatronConfig.of(args)
    on_gpu = torch.cuda.is_available()
    dtype = params_dtype(args)
    config_class = MLATransformerConfig if megatron.multi_latent_attention else TransformerConfig
    vime_values = dict(
        num_layers=megatron.num_layers,
        hidden_size=megatron.hidden_size,
        ffn_hidden_size=megatron.ffn_hidden_size,
        num_attention_heads=megatron.num_attention_heads,
        num_query_groups=megatron.num_query_groups,
        kv_channels=megatron.kv_channels,
        tensor_model_parallel_size=megatron.tensor_model_parallel_size,
        pipeline_model_parallel_size=megatron.pipeline_model_parallel_size,
        # SwiGLU MLP, RMSNorm, no linear biases except the optional qkv bias (Qwen2).
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=megatron.norm_epsilon,
        add_bias_linear=False,
        add_qkv_bias=bool(megatron.add_qkv_bias),
        qk_layernorm=bool(megatron.qk_layernorm),
        attention_dropout=megatron.attention_dropout,
        hidden_dropout=megatron.hidden_dropout,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # RL micro-batches differ in length, so pipeline stages exchange shapes before activations.
        variable_seq_lengths=True,
        **_moe_config(args),
        **_mla_config(args),
        linear_attention_freq=megatron.linear_attention_freq,  # Qwen3-Next's hybrid layers (the rest: generated)
        use_cpu_initialization=not on_gpu,
        # Fused kernels need CUDA (some need apex); off everywhere, so CPU and GPU run the same math.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    config = config_class(**{**vime_values, **_given_transformer_fields(args, config_class)})
    if config.sequence_parallel and not on_gpu:
        redirect_backward_for_sequence_parallel()
    return config


def _given_transformer_fields(args: argparse.Namespace, config_class: type) -> dict:
    """The generated Megatron flags a launch script set for this config (`megatron_flags.given_fields`), which win
    over vime's values: activation recompute (--recompute-granularity/-method/-num-layers/-modules),
    --sequence-parallel, --init-method-std, ... Multi-latent-attention fields on another model are ignored with a
    warning."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    given = given_fields(args, "transformer")
    given.pop("rotary_percent", None)  # the HF config's partial rotary, which `build_gpt_model` gives the model
    for name in sorted(set(given) - fields):
        warn_once(f"--{name.replace('_', '-')} applies to multi-latent attention models only: ignored")
    return {name: value for name, value in given.items() if name in fields}


def _moe_config(args: argparse.Namespace) -> dict:
    """TransformerConfig's MoE fields (Qwen3-MoE: softmax top-k routing; DeepSeek-V3: sigmoid routing with the
    expert bias, expert groups, scaled weights and shared experts)."""
    megatron = MegatronConfig.of(args)
    routing_replay = RoutingReplayConfig.of(args)
    if not megatron.num_experts:  # dense; alltoall because the default dispatcher refuses
        return {"moe_token_dispatcher_type": "alltoall"}  # variable sequence lengths even where unused
    return dict(
        num_moe_experts=megatron.num_experts,
        moe_router_topk=megatron.moe_router_topk,
        moe_ffn_hidden_size=megatron.moe_ffn_hidden_size,
        moe_layer_freq=list(megatron.moe_layer_freq),
        moe_router_pre_softmax=bool(args.moe_router_pre_softmax),
        moe_router_score_function=megatron.moe_router_score_function or "softmax",
        moe_router_enable_expert_bias=bool(megatron.moe_router_enable_expert_bias),
        moe_router_bias_update_rate=megatron.moe_router_bias_update_rate,
        moe_router_num_groups=megatron.moe_router_num_groups,
        moe_router_group_topk=megatron.moe_router_group_topk,
        moe_router_topk_scaling_factor=megatron.moe_router_topk_scaling_factor,
        moe_shared_expert_intermediate_size=megatron.moe_shared_expert_intermediate_size,
        moe_router_load_balancing_type=megatron.moe_router_load_balancing_type,
        moe_aux_loss_coeff=megatron.moe_aux_loss_coeff or 0.0,
        moe_z_loss_coeff=megatron.moe_z_loss_coeff,
        moe_token_dispatcher_type=megatron.moe_token_dispatcher_type,
        moe_grouped_gemm=bool(megatron.moe_grouped_gemm) and use_gpu(),  # on CPU one GEMM per expert (warned)
        moe_router_dtype=megatron.moe_router_dtype,
        expert_model_parallel_size=megatron.expert_model_parallel_size,
        expert_tensor_parallel_size=megatron.expert_tensor_parallel_size or megatron.tensor_model_parallel_size,
        moe_enable_routing_replay=bool(routing_replay.use_rollout_routing_replay
                                       or routing_replay.use_routing_replay),  # vime.trainer.routing_replay
    )


def _mla_config(args: argparse.Namespace) -> dict:
    """MLATransformerConfig's fields for multi-latent attention (DeepSeek-V3), {} for other attention: plain RoPE
    on the rotary part, or YaRN with the HF config's parameters (its frequencies, its cos/sin scale and the
    softmax scale of mscale_all_dim, as transformers computes them)."""
    megatron = MegatronConfig.of(args)
    if not megatron.multi_latent_attention:
        return {}
    mla = dict(q_lora_rank=megatron.q_lora_rank, kv_lora_rank=megatron.kv_lora_rank, qk_head_dim=megatron.qk_head_dim,
               qk_pos_emb_head_dim=megatron.qk_pos_emb_head_dim, v_head_dim=megatron.v_head_dim,
               rotary_base=megatron.rotary_base)
    yarn = megatron.rope_scaling
    if yarn is None:
        return {**mla, "rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    return {**mla, "rope_type": "yarn", "rotary_scaling_factor": yarn["factor"],
            "original_max_position_embeddings": int(yarn["original_max_position_embeddings"]),
            "beta_fast": yarn["beta_fast"], "beta_slow": yarn["beta_slow"], "mscale": yarn["mscale"],
            "mscale_all_dim": yarn["mscale_all_dim"]}


def _without_transformer_engine() -> None:
    """megatron-core 0.16.1 without TransformerEngine: the MoE utilities name `te_general_gemm` only when TE
    imports, and multi-latent attention believes TE is there (its TE classes are mock stand-ins, which its
    isinstance checks cannot take). Its `CheckpointWithoutOutput` (selective recompute of the norms, the MoE
    activation) reads `fp8=False` as FP8 on (`fp8 is not None`) and then calls TE's FP8 state manager."""
    import megatron.core.tensor_parallel.random as mcore_random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    mla.HAVE_TE = False
    if not mcore_random.HAVE_TE and not hasattr(mcore_random.CheckpointWithoutOutput, "_vime_no_fp8"):
        init = mcore_random.CheckpointWithoutOutput.__init__

        def init_without_fp8(self, fp8=False):
            init(self, fp8)
            self.fp8 = False  # FP8 needs TransformerEngine, which is not there

        mcore_random.CheckpointWithoutOutput.__init__ = init_without_fp8
        mcore_random.CheckpointWithoutOutput._vime_no_fp8 = True


class LocalNorm:
    """The local spec's norm: torch's RMSNorm (or LayerNorm), as megatron's `WrappedTorchNorm` builds it, but with
    sequence parallel too. Under sequence parallel each TP rank normalises its own slice of the sequence, so the
    norm weights' gradients are partial sums: their parameters are marked `sequence_parallel`, which
    `finalize_model_grads` all-reduces over the TP group (as Megatron's Apex and TE norms mark theirs).
    `WrappedTorchNorm` refuses sequence parallel outright instead. Its weight is in the model's dtype: a float32
    weight under bf16 inputs takes torch's unfused path ("Mismatch dtype ... Cannot dispatch to fused")."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if getattr(config, "layernorm_zero_centered_gamma", False):  # Qwen3-Next's norms scale by 1 + weight
            norm = ZeroCenteredRMSNorm(hidden_size, eps, config.params_dtype)
        else:
            norm_class = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
            norm = norm_class(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight is stored centred on 0 and scales by 1 + weight, in float32 (Qwen3-Next's norms, as
    transformers computes them; Megatron's `layernorm_zero_centered_gamma`, which torch's own norms lack)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def _use_local_norm(spec) -> None:
    """Swap `WrappedTorchNorm` for `LocalNorm` everywhere in a local layer spec's (nested) submodules."""
    submodules = getattr(spec, "submodules", None)
    if not dataclasses.is_dataclass(submodules):
        return
    for field in dataclasses.fields(submodules):
        value = getattr(submodules, field.name)
        if value is WrappedTorchNorm:
            setattr(submodules, field.name, LocalNorm)
        elif isinstance(value, ModuleSpec) and value.module is WrappedTorchNorm:
            value.module = LocalNorm
        elif isinstance(value, ModuleSpec):
            _use_local_norm(value)


def _layer_specs(config: TransformerConfig, vp_stage: int | None = None):
    """The decoder's spec: a layer spec for all layers (TE, dense), or a block spec with per-layer MoE / dense
    MLPs and, for the local spec, its final norm."""
    te = use_transformer_engine()
    if not te:
        _without_transformer_engine()
    mla = bool(config.multi_latent_attention)
    if te and not config.num_moe_experts:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, multi_latent_attention=mla)
    if config.num_moe_experts:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
        if te:
            return block
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm,
                                        multi_latent_attention=mla)
        # this stage's layers, as TransformerBlock would expand a layer spec
        block = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage),
                                           layer_norm=WrappedTorchNorm)
    block.layer_norm = LocalNorm  # the final norm
    linear = config.linear_attention_freq
    if linear:  # a spec per layer: Gated DeltaNet where the pattern says 1
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        block.layer_specs = [copy.deepcopy(layer) for layer in block.layer_specs]
    for i, layer in enumerate(block.layer_specs):
        if linear and linear[offset + i]:
            layer.submodules.self_attention = ModuleSpec(module=GatedDeltaNetAttention)
        else:  # torch's fused scaled-dot-product attention, which also takes packed (thd) micro-batches
            layer.submodules.self_attention.submodules.core_attention = SDPAttention
        _use_local_norm(layer)
    return block


def build_gpt_model(args: argparse.Namespace, pre_process: bool = True, post_process: bool = True,
                    vp_stage: int | None = None) -> GPTModel:
    """One GPTModel chunk. `pre_process` holds the embedding (first stage), `post_process` the final norm
    and output layer (last stage). Logits come out vocab-parallel over TP: [batch, seq, vocab / TP]."""
    megatron = MegatronConfig.of(args)
    config = build_transformer_config(args)
    use_packed_rope()  # packed sequences' RoPE without a host read per layer
    layer_specs = _layer_specs(config, vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_specs,
        vocab_size=megatron.vocab_size,
        max_sequence_length=megatron.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not megatron.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_percent=core_flag(args, "rotary_percent") or 1.0,  # partial rotary (GLM-4.5), from the HF config
        rotary_base=megatron.rotary_base,
        vp_stage=vp_stage,
    )
    if post_process and megatron.mtp_num_layers:  # shaped like the decoder's last attention layer (MoE where it is)
        attention = [s for s in getattr(layer_specs, "layer_specs", [layer_specs])  # (TE dense: one spec for all)
                     if s.submodules.self_attention.module is not GatedDeltaNetAttention]
        attach_mtp(model, attention[-1], megatron.mtp_num_layers, LocalNorm, trainable=megatron.enable_mtp_training,
                   embeds_first_position=bool(megatron.mtp_embeds_first_position))
    scaling = megatron.rope_scaling
    if scaling is not None and not config.multi_latent_attention:  # MLA builds its own (YaRN) rotary embedding
        rope = model.rotary_pos_emb
        rope.inv_freq = scaled_inv_freq(rope, scaling)
    return model


def scaled_inv_freq(rope, scaling: dict) -> torch.Tensor:
    """The RoPE frequencies of an HF `rope_scaling` block, computed as transformers does (bit for bit):
    llama3 scales the low frequencies by 1/factor and blends the middle band; linear divides all by factor."""
    if scaling["rope_type"] == "linear":
        return rope.inv_freq / scaling["factor"]
    return rope._apply_scaling(rope.inv_freq, factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                               high_freq_factor=scaling["high_freq_factor"],
                               original_max_position_embeddings=scaling["original_max_position_embeddings"])


def build_model_chunks(args: argparse.Namespace) -> list[GPTModel]:
    """This rank's model chunks (one per rank; no virtual pipeline), unwrapped: the trainer wraps them in DDP.

    Stage placement comes from `parallel_state`, which must be initialised (`parallel.init_parallel`).
    """
    model = build_gpt_model(
        args,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    return [model.to(training_device())]
