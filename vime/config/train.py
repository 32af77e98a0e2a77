"""Sections of the training side: the Megatron-LM flags vime declares, the training loop, weight sync, LoRA and
routing replay."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Literal

from vime.config.section import Section, derived, flag


def _layer_pattern(text: str) -> list[int]:
    """--moe-layer-freq: "N" (every N-th layer is MoE, counting from 1) is kept as N; "[0, 1, 1]" as a list."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a JSON list of 0/1") from e
    if isinstance(value, int) or (isinstance(value, list) and all(v in (0, 1) for v in value)):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a JSON list of 0/1")


_FROM_HF = " (default: None = from the HF config)."  # the end of each architecture flag's help


@dataclasses.dataclass(frozen=True)
class MegatronConfig(Section):
    """The Megatron-LM flags vime declares itself (vime/trainer/megatron/megatron_flags.py generates the rest):
    parallelism, optimizer, precision, MoE, checkpoints, architecture."""

    # Its flags sit in six --help groups (vime/trainer/megatron/arguments.py), each its own part but the optimizer's
    tensor_model_parallel_size: int = flag(
        1, "Tensor-parallel size: ranks that split each layer's matrices (default: %(default)s).", part="parallelism")
    pipeline_model_parallel_size: int = flag(
        1, "Pipeline-parallel size: ranks that split the layers into stages (default: %(default)s).",
        part="parallelism")
    micro_batch_size: int = flag(1, "Sequences per micro-batch per data-parallel rank (default: %(default)s).",
                                 part="parallelism")
    global_batch_size: int | None = flag(
        None, "Sequences per optimizer step over all data-parallel ranks; a multiple of micro-batch-size x "
        "data-parallel size (default: None = micro-batch-size x DP size).", part="parallelism")
    expert_model_parallel_size: int = flag(
        1, "Expert-parallel size (MoE): ranks that split each MoE layer's experts, carved from the data-parallel "
        "ranks (default: %(default)s).", part="parallelism")
    expert_tensor_parallel_size: int | None = flag(
        None, "Tensor-parallel size inside each expert (default: None = --tensor-model-parallel-size).",
        part="parallelism")
    qkv_format: Literal["thd", "bshd"] = flag(
        "thd", "Micro-batch layout: thd = the sequences packed one after another without padding (each attends only "
        "to itself); bshd = right-padded to the longest (default: %(default)s).", part="parallelism")

    lr: float = flag(1e-06, "Peak learning rate (default: 1e-6).")
    min_lr: float = flag(0.0, "Learning rate at the end of decay (default: %(default)s).")
    lr_decay_style: Literal["constant", "linear", "cosine"] = flag(
        "constant", "Learning-rate decay after warmup (default: %(default)s).")
    lr_warmup_iters: int = flag(0, "Optimizer steps of linear warmup from 0 to --lr (default: %(default)s).")
    weight_decay: float = flag(0.01, "AdamW weight decay (default: %(default)s).")
    adam_beta1: float = flag(0.9, "Adam beta1 (default: %(default)s).")
    adam_beta2: float = flag(0.999, "Adam beta2 (default: %(default)s).")
    adam_eps: float = flag(1e-08, "Adam epsilon (default: 1e-8).")
    clip_grad: float = flag(1.0, "Clip the global gradient L2 norm to this value; 0 disables (default: %(default)s).")
    use_distributed_optimizer: bool = flag(False, "Shard optimizer states over data-parallel ranks (default: off).")

    bf16: bool = flag(False, "bfloat16 parameters and compute on GPU; ignored on CPU, which trains in float32 "
                      "(default: off).", part="precision")
    fp16: bool = flag(False, "float16 parameters and compute on GPU; ignored on CPU (default: off).", part="precision")
    attention_dropout: float = flag(
        0.0, "Dropout on attention probabilities (default: 0.0; Megatron-LM's is 0.1, but RL needs the trainer's "
        "log-probs to match the rollout engine's).", part="precision")
    hidden_dropout: float = flag(0.0, "Dropout on hidden states (default: 0.0; Megatron-LM's is 0.1).",
                                 part="precision")

    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = flag(
        "aux_loss", "Load-balancing loss of the router (default: aux_loss, weighted by --moe-aux-loss-coeff).",
        part="moe")
    moe_aux_loss_coeff: float | None = flag(
        None, "Weight of the load-balancing loss (default: None = the HF config's router_aux_loss_coef, else 0).",
        part="moe")
    moe_z_loss_coeff: float | None = flag(None, "Weight of the router z-loss (default: None = off).", part="moe")
    moe_token_dispatcher_type: Literal["alltoall"] = flag(
        "alltoall", "How tokens reach their experts (default: alltoall, the dispatcher that takes RL's "
        "variable-length micro-batches).", part="moe")
    moe_grouped_gemm: bool = flag(
        False, "Grouped GEMM for the experts (GPU with TransformerEngine; default: off = one GEMM per expert).",
        part="moe")
    moe_router_dtype: Literal["fp32", "fp64"] = flag(
        "fp32", "Precision of the router's logits and probabilities (default: %(default)s).", part="moe")
    moe_router_bias_update_rate: float = flag(
        0.001, "Step of the expert-bias update after each optimizer step (aux-loss-free load balancing, models with "
        "an expert bias such as DeepSeek-V3; the bias goes to the engines with the weights; 0 freezes it; default: "
        "1e-3, Megatron-LM's).", part="moe")

    mtp_num_layers: int | None = flag(
        None, "Multi-token-prediction (MTP) layers to hold after the decoder, read from and saved to the "
        "checkpoint's own (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5); their weights go to the engines, and to "
        "their drafter with --vllm-speculative-config, with each weight update (default: None = none).", part="mtp")
    enable_mtp_training: bool = flag(
        False, "Train the MTP layers online on the rollout's tokens (predicting each token from the one two before "
        "it), so that the rollout's drafter keeps up with the policy. The trunk is detached: the MTP loss trains the "
        "MTP layers only, never changes the policy's gradient, and is left out of the gradient norm the policy is "
        "clipped by (default: off = the MTP layers stay as loaded).", part="mtp")
    mtp_loss_scaling_factor: float = flag(
        0.1, "Weight of the MTP loss (mean cross-entropy per MTP layer) in the step's loss (default: 0.1, "
        "Megatron-LM's).", part="mtp")

    load: str | None = flag(
        None, "torch_dist checkpoint directory to resume from (default: None = start from --hf-checkpoint).",
        part="checkpoints")
    ref_load: str | None = flag(  # slime's: the KL reference, and the actor's start when --load holds none
        None, "slime's reference checkpoint (torch_dist, as scripts/convert_hf_to_torch_dist.py writes it, or an HF "
        "directory): the KL reference of --use-kl-loss / --kl-coef, and the actor's first weights when --load holds "
        "no checkpoint (default: None = the reference is the actor's first weights).", part="checkpoints")
    save: str | None = flag(None, "Directory for torch_dist checkpoints (default: None = no saving).",
                            part="checkpoints")
    save_interval: int | None = flag(None, "Save every this many rollouts (default: None = only at the end).",
                                     part="checkpoints")
    save_retain: int | None = flag(
        None, "Keep only the newest this many checkpoints in --save, never the one a resume starts from (default: "
        "None = keep all).", part="checkpoints")
    no_load_optim: bool = flag(False, "Do not load optimizer state from --load (default: off).", part="checkpoints")
    no_load_rng: bool = flag(False, "Do not load RNG state from --load (default: off).", part="checkpoints")
    finetune: bool = flag(
        False, "Load only the weights from --load and restart the iteration count at 0 (default: off).",
        part="checkpoints")

    # architecture: None = read from the --hf-checkpoint config.json (fill_architecture_from_hf)
    num_layers: int | None = flag(None, "Transformer layers (num_hidden_layers)" + _FROM_HF, part="architecture")
    hidden_size: int | None = flag(None, "Hidden size (hidden_size)" + _FROM_HF, part="architecture")
    ffn_hidden_size: int | None = flag(None, "MLP intermediate size (intermediate_size)" + _FROM_HF,
                                       part="architecture")
    num_attention_heads: int | None = flag(None, "Query heads (num_attention_heads)" + _FROM_HF, part="architecture")
    num_query_groups: int | None = flag(
        None, "Key/value heads for grouped-query attention (num_key_value_heads)" + _FROM_HF, part="architecture")
    kv_channels: int | None = flag(None, "Per-head dimension (head_dim)" + _FROM_HF, part="architecture")
    rotary_base: float | None = flag(None, "RoPE theta (rope_parameters.rope_theta)" + _FROM_HF, part="architecture")
    norm_epsilon: float | None = flag(None, "RMSNorm epsilon (rms_norm_eps)" + _FROM_HF, part="architecture")
    vocab_size: int | None = flag(None, "Vocabulary size of the embedding and output layer (vocab_size)" + _FROM_HF,
                                  part="architecture")
    max_position_embeddings: int | None = flag(
        None, "Longest sequence for position embeddings (max_position_embeddings)" + _FROM_HF, part="architecture")
    num_experts: int | None = flag(
        None, "Routed experts per MoE layer (num_experts; default: None = from the HF config, none for dense models).",
        part="architecture")
    moe_router_topk: int | None = flag(
        None, "Experts each token is routed to (num_experts_per_tok; default: None = from the HF config).",
        part="architecture")
    moe_ffn_hidden_size: int | None = flag(
        None, "Hidden size of each expert's MLP (moe_intermediate_size; default: None = from the HF config).",
        part="architecture")
    moe_layer_freq: int | list[int] | None = flag(
        None, "Which layers are MoE: N (layers 0, N, 2N, ...) or a JSON list of 0/1 per layer (decoder_sparse_step "
        "and mlp_only_layers; default: None = from the HF config).", parse=_layer_pattern, part="architecture")
    moe_router_score_function: str | None = flag(None, "Router scores: softmax or sigmoid (scoring_func)" + _FROM_HF,
                                                 parse=str, part="architecture")  # its flags.md entry says type str
    moe_router_num_groups: int | None = flag(None, "Expert groups of group-limited routing (n_group)" + _FROM_HF,
                                             part="architecture")
    moe_router_group_topk: int | None = flag(None, "Groups each token may route into (topk_group)" + _FROM_HF,
                                             part="architecture")
    moe_router_topk_scaling_factor: float | None = flag(
        None, "Scale of the routing weights (routed_scaling_factor)" + _FROM_HF, part="architecture")
    moe_shared_expert_intermediate_size: int | None = flag(
        None, "Hidden size of the shared experts, all of them together (n_shared_experts x moe_intermediate_size)"
        + _FROM_HF, part="architecture")
    q_lora_rank: int | None = flag(None, "Multi-latent attention: rank of the query compression (q_lora_rank)"
                                   + _FROM_HF, part="architecture")
    kv_lora_rank: int | None = flag(None, "Multi-latent attention: rank of the key/value latent (kv_lora_rank)"
                                    + _FROM_HF, part="architecture")
    qk_head_dim: int | None = flag(
        None, "Multi-latent attention: query/key head size without position (qk_nope_head_dim)" + _FROM_HF,
        part="architecture")
    qk_pos_emb_head_dim: int | None = flag(
        None, "Multi-latent attention: rotary part of the query/key heads (qk_rope_head_dim)" + _FROM_HF,
        part="architecture")
    v_head_dim: int | None = flag(None, "Multi-latent attention: value head size (v_head_dim)" + _FROM_HF,
                                  part="architecture")
    rope_scaling_factor: float | None = flag(
        None, "Llama 3.x RoPE scaling factor (rope_scaling.factor; default: None = from the HF config).",
        part="architecture")
    use_rope_scaling: bool | None = flag(
        None, "Llama 3.x RoPE frequency scaling (rope_scaling.rope_type llama3)" + _FROM_HF, part="architecture")
    untie_embeddings_and_output_weights: bool | None = flag(
        None, "Separate output layer, not tied to the embedding (not tie_word_embeddings)" + _FROM_HF,
        part="architecture")
    qk_layernorm: bool | None = flag(None, "RMSNorm on queries and keys per head (Qwen3)" + _FROM_HF,
                                     part="architecture")
    add_qkv_bias: bool | None = flag(None, "Bias on the query/key/value projection (Qwen2)" + _FROM_HF,
                                     part="architecture")
    multi_latent_attention: bool | None = flag(None, "Multi-latent attention (DeepSeek-V3)" + _FROM_HF,
                                               part="architecture")
    moe_router_enable_expert_bias: bool | None = flag(
        None, "Expert bias in the routing choice (e_score_correction_bias, DeepSeek-V3's topk_method noaux_tc)"
        + _FROM_HF, part="architecture")
    # the checkpoint's RoPE scaling (rope_type, factor, ...), no flag: each training rank reads it from the HF config
    rope_scaling: dict[str, Any] | None = derived()
    # which layers are Gated DeltaNet (1) or full attention (0), no flag: from the HF config's layer_types
    linear_attention_freq: list[int] | None = derived()
    # whether an MTP layer reads the next token's embedding at a sequence's first position (Qwen3-Next's and
    # Qwen3.5's drafters) or zero there (DeepSeek-V3's, GLM-4.5's), no flag: from the HF config's model type
    mtp_embeds_first_position: bool | None = derived()


@dataclasses.dataclass(frozen=True)
class TrainLoopConfig(Section):
    """How a rollout becomes optimizer steps, and the async loop's staleness (`--num-steps-per-rollout`, ...)."""

    # the "training loop" --help group shows these (part "batch"), then WeightSyncConfig's, then the part-less ones
    num_steps_per_rollout: int | None = flag(
        None, "Optimizer steps per rollout; sets --global-batch-size to the rollout's samples divided by it (default: "
        "1 step, or from --global-batch-size).", part="batch")
    use_dynamic_batch_size: bool = flag(
        False, "Cut micro-batches by tokens (--max-tokens-per-gpu; real tokens with --qkv-format thd, padded ones with "
        "bshd) instead of sample count (default: off).", part="batch")
    max_tokens_per_gpu: int | None = flag(
        None, "Tokens per micro-batch with --use-dynamic-batch-size (default: %(default)s).", part="batch")
    share_group_prompts: bool = flag(
        True, "Pack the samples of a micro-batch that share a prompt (a GRPO group) as one copy of the prompt followed "
        "by their responses, each response attending to the prompt and itself: the prompt goes through forward and "
        "backward once, not once per sample, for the same loss and gradients. Used where the model allows it (packed "
        "thd sequences, vime's SDPA attention, RoPE, a dense model, no context parallel, no --lora-adapters or "
        "routing replay); the trainer logs which at start-up (default: on).",
        action=argparse.BooleanOptionalAction, part="batch")
    train_num_threads: int | None = flag(
        None, "torch threads of each training rank (default: None = one per CPU of the rank's share of its node: all "
        "of the node's CPUs split between the training ranks in train.py, split with the engines in "
        "train_async.py).", part="batch")
    update_weights_interval: int = flag(1, "train_async.py: push weights to the engines every this many rollouts "
                                        "(default: %(default)s).")
    max_staleness: int | None = flag(
        None, "train_async.py continuous mode: generate up to K rollouts ahead of training, back to back on the "
        "engines, and push every update in flight (--update-weights-in-flight); a sample with a token sampled more "
        "than K weight versions before the weights it would train is left out of the loss and counted "
        "(async/stale_samples_dropped). Without it: one rollout ahead (default: off).")
    update_weights_in_flight: bool = flag(
        False, "train_async.py: push each update into the engines as soon as it is trained, between decode steps of "
        "the rollout they are generating, instead of after it: its requests continue under the new weights (their "
        "KV recomputed), and each token records the version that sampled it (weight_version_spans). Less stale data "
        "for the same overlap; combine with --use-tis or --use-mis to correct each token by its own sampling policy "
        "(default: off).")
    critic_lr: float | None = flag(None, "Learning rate of the PPO critic (default: --lr).")
    save_hf: str | None = flag(None, "Path template with {rollout_id}: also export HF safetensors when saving "
                               "(default: %(default)s).")
    keep_old_actor: bool = flag(
        False, "Keep a copy of the weights the engines generated with (slime's old actor) and compute the old "
        "log-probs under it rather than under the current weights: with train_async.py the rollout in training was "
        "generated by the weights one update back. Costs a copy of the weights in the trainer's memory (default: "
        "off).")
    # slime's trainer hooks (function paths), in their own --help group
    custom_megatron_init_path: str | None = flag(
        None, "init(args), called once Megatron's parallel groups exist, before the model is built (default: "
        "%(default)s).", part="hooks")
    custom_megatron_before_log_prob_hook_path: str | None = flag(
        None, "hook(args, model, store_prefix) before each log-prob pass over a rollout: store_prefix 'ref_' (the KL "
        "reference), 'teacher_' (distillation) or '' (the old policy) (default: %(default)s).", part="hooks")
    custom_megatron_before_train_step_hook_path: str | None = flag(
        None, "hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) before each optimizer step's "
        "forward and backward (default: %(default)s).", part="hooks")
    rollout_data_postprocess_path: str | None = flag(
        None, "postprocess(args, rollout_id, rollout_data), called after the log-probs and advantages are computed, "
        "before training; rollout_data holds per-sample lists (tokens, loss_masks, log_probs, ref_log_probs, "
        "rollout_log_probs, advantages, returns, rewards, ...) that it may change in place, e.g. the loss masks "
        "(default: %(default)s).", part="hooks")

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

    update_weight_transport: Literal["disk", "broadcast", "delta", "cuda_ipc"] = flag(
        "disk", "How new weights reach the engines: disk = HF safetensors the engines reload; broadcast = in memory "
        "over a gloo/nccl group between the training writers and the engines (starts engines with vime's worker "
        "extension); delta = like disk, but only the tensors whose content hash changed since the last sync, for "
        "engines behind a slow link; cuda_ipc = colocated GPUs, engines map the trainer's tensors (default: "
        "%(default)s).")
    update_weight_dir: str | None = flag(
        None, "Root of the disk and delta transports' update directories (each a fresh 0700 directory; engines load "
        "only from under it); must be visible to the engines (default: /dev/shm/vime-<uid>, private to this user).")
    update_weight_buffer_size: int = flag(
        536870912, "Bucket size of the broadcast transport, in bytes: small tensors travel packed in flat buckets of "
        "at most this size; a tensor of 1 MiB or more, or of at least this size, travels on its own (default: "
        "536870912 = 512 MiB).")
    check_weight_update_equal: bool = flag(
        False, "After each weight update, check that every engine's prompt log-probs of a fixed probe sequence equal "
        "the trainer's (within 1e-5 + 1e-6 x |log-prob| in float32 on CPU; other devices and dtypes: "
        "vime/utils/tolerances.py) and stop with an error if not (default: off).")

    def check(self) -> None:
        if self.update_weight_buffer_size < 1:
            raise ValueError(f"--update-weight-buffer-size must be >= 1 byte, got {self.update_weight_buffer_size}")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # HF projection names


@dataclasses.dataclass(frozen=True)
class LoraConfig(Section):
    """LoRA training and adapters (`--lora-*`)."""

    lora_rank: int = flag(0, "Train LoRA adapters of this rank on a frozen base (0 = full fine-tuning); --lora-sync "
                          "says what the engines get (default: %(default)s).")
    lora_alpha: float | None = flag(None, "LoRA scaling numerator: delta W = alpha / rank * B A (default: "
                                    "--lora-rank).")
    lora_dropout: float = flag(0.0, "Dropout on the adapters' input while training (default: %(default)s).")
    lora_load: str | None = flag(
        None, "Start the adapters from a PEFT LoRA adapter (adapter_config.json and adapter_model.safetensors; its "
        "rank, alpha and targets become the run's) instead of fresh ones (default: %(default)s).", metavar="DIR")
    lora_sync: Literal["adapter", "merged"] | None = flag(
        None, "What a weight update sends the engines: adapter = the adapters alone, served through vLLM's LoRA "
        "support (engines started with it enabled); merged = the full merged weights through "
        "--update-weight-transport, for engines without LoRA support (default: adapter; merged for "
        "--rollout-external-engine-addrs, and for MoE models on CPU, whose vLLM engine cannot serve adapters).")
    lora_adapters: list[str] | None = flag(
        None, "Multi-LoRA: train several named adapters on the one base in the same steps, each on its own prompts, "
        "scored by its own RM (an --rm-type name or a function path; default: the run's reward), served by the same "
        "engines under its name; repeatable. Replaces --prompt-data; each rollout takes an equal share of prompts "
        "from every adapter's data (default: None = one adapter, served as the policy).",
        action="extend", nargs="+", metavar="NAME=PROMPT_DATA[:RM]")
    lora_target_modules: list[str] = flag(
        ["all-linear"], f"HF projections that get adapters: {', '.join(LORA_TARGETS)}, or all-linear (default: "
        "all-linear).", metavar="NAME")

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

    use_rollout_routing_replay: bool = flag(
        False, "MoE models: the engines return the experts they routed each token to, and every trainer forward of "
        "the rollout replays them, so the trainer computes the policy the engine sampled from (default: off).")
    use_routing_replay: bool = flag(
        False, "MoE models: record the trainer's routing in the rollout's first forward (old log-probs) and replay it "
        "in the rollout's optimizer steps (default: off; --use-rollout-routing-replay, which replays the engine's "
        "routing everywhere, takes precedence).")
