"""Sections of the training side: Megatron-LM's hand-declared flags, the training loop, weight sync, LoRA and
routing replay."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from vime.config.section import Section, derived


@dataclasses.dataclass(frozen=True)
class MegatronConfig(Section):
    """Megatron-LM's hand-declared flags: parallelism, optimizer, precision, MoE, checkpoints, architecture."""


    # parallelism and batch
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    qkv_format: Literal["thd", "bshd"] = "thd"

    # optimizer
    lr: float = 1e-06
    min_lr: float = 0.0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_iters: int = 0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False

    # precision and regularisation
    bf16: bool = False
    fp16: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0

    # mixture of experts
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    moe_aux_loss_coeff: float | None = None
    moe_z_loss_coeff: float | None = None
    moe_token_dispatcher_type: Literal["alltoall"] = "alltoall"
    moe_grouped_gemm: bool = False
    moe_router_dtype: Literal["fp32", "fp64"] = "fp32"
    moe_router_bias_update_rate: float = 0.001

    # checkpoints
    load: str | None = None
    ref_load: str | None = None  # slime's: the KL reference, and the actor's start when --load holds none
    save: str | None = None
    save_interval: int | None = None
    save_retain: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False

    # model architecture
    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    rotary_base: float | None = None
    norm_epsilon: float | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int | list[int] | None = None
    moe_router_score_function: str | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_shared_expert_intermediate_size: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_scaling_factor: float | None = None
    use_rope_scaling: bool | None = None
    untie_embeddings_and_output_weights: bool | None = None
    qk_layernorm: bool | None = None
    add_qkv_bias: bool | None = None
    multi_latent_attention: bool | None = None
    moe_router_enable_expert_bias: bool | None = None
    # the checkpoint's RoPE scaling (rope_type, factor, ...), no flag: each training rank reads it from the HF config
    rope_scaling: dict[str, Any] | None = derived()


@dataclasses.dataclass(frozen=True)
class TrainLoopConfig(Section):
    """How a rollout becomes optimizer steps, and the async loop's staleness (`--num-steps-per-rollout`, ...)."""

    num_steps_per_rollout: int | None = None
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    share_group_prompts: bool = True
    train_num_threads: int | None = None
    update_weights_interval: int = 1
    max_staleness: int | None = None
    update_weights_in_flight: bool = False
    critic_lr: float | None = None
    save_hf: str | None = None
    keep_old_actor: bool = False
    # slime's trainer hooks (function paths)
    custom_megatron_init_path: str | None = None
    custom_megatron_before_log_prob_hook_path: str | None = None
    custom_megatron_before_train_step_hook_path: str | None = None
    rollout_data_postprocess_path: str | None = None

    def check(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 1:
            raise ValueError(f"--max-staleness must be >= 1 (rollouts generated ahead of training), got "
                             f"{self.max_staleness}; omit it for one rollout ahead")
        if self.max_staleness is not None and self.update_weights_interval > 1:
            raise ValueError("--max-staleness pushes every update in flight: drop --update-weights-interval "
                             f"{self.update_weights_interval}, or drop --max-staleness")
        if self.train_num_threads is not None and self.train_num_threads < 1:
            raise ValueError(f"--train-num-threads must be >= 1, got {self.train_num_threads}")
        if self.use_dynamic_batch_size and not self.max_tokens_per_gpu:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu N")


@dataclasses.dataclass(frozen=True)
class WeightSyncConfig(Section):
    """How trained weights reach the engines (`--update-weight-*`, `--check-weight-update-equal`)."""

    update_weight_transport: Literal["disk", "broadcast", "delta", "cuda_ipc"] = "disk"
    update_weight_dir: str | None = None
    update_weight_buffer_size: int = 536870912
    check_weight_update_equal: bool = False

    def check(self) -> None:
        if self.update_weight_buffer_size < 1:
            raise ValueError(f"--update-weight-buffer-size must be >= 1 byte, got {self.update_weight_buffer_size}")


@dataclasses.dataclass(frozen=True)
class LoraConfig(Section):
    """LoRA training and adapters (`--lora-*`)."""

    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_load: str | None = None
    lora_sync: Literal["adapter", "merged"] | None = None
    lora_adapters: list[str] | None = None
    lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])

    def check(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")


@dataclasses.dataclass(frozen=True)
class RoutingReplayConfig(Section):
    """Replaying the engines' MoE routing in training (`--use-*routing-replay`)."""

    use_rollout_routing_replay: bool = False
    use_routing_replay: bool = False
