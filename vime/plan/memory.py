"""The memory of one device of each role, predicted from the model's shape and the run's layout: pure arithmetic,
nothing allocated.

    trainer = trainer_memory(shape, TrainerLayout(tp=2, pp=1, dp=4, micro_batch_tokens=8192, logit_rows=6144))
    trainer.peak_bytes, trainer.parts   # {"weights": ..., "gradients": ..., "optimizer": ..., "activations": ...}

What a trainer rank holds (Megatron's DDP and optimizer, as vime sets them up in `trainer.megatron.model`):
- weights in the training dtype; the gradient buffer in float32 (`grad_reduce_in_fp32`) for trainable weights;
- Adam's two moments in float32, plus float32 master weights under 16-bit training; all three sharded over the
  data-parallel ranks with the distributed optimizer;
- on-device weight snapshots (the KL reference, the distillation teacher: `trainer.weight_snapshots`);
- the activations autograd saves for one micro-batch (the first pipeline stage holds up to `pp` in flight under
  1F1B), by module as vime's local layer spec saves them (counted with torch's saved-tensor hooks on this CPU:
  tests/unit/test_memory_plan.py), or the layer inputs alone plus one layer's under full recompute;
- the output layer's logits for the response rows only, and what the log-prob computation holds over them
  (`trainer.log_probs`: float32 logits keep their log-softmax; 16-bit ones are processed in float32 chunks).
An engine holds its weights and fills `--vllm-gpu-memory-utilization` of the device with its KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vime.trainer.flops import FlopShape

GIB = 2**30
FP32 = 4
LOG_PROB_CHUNK_ELEMENTS = 2**23  # trainer.log_probs.CHUNK_ELEMENTS: the float32 working set of a chunk
CHUNK_COPIES = 8  # float32 copies of a chunk alive at once in the chunked log-prob backward (measured)
WHOLE_BLOCK_LIMIT = 2**28  # float32 logits of fewer elements take the whole-block log_softmax
CUDA_OVERHEAD_BYTES = 1.5 * GIB  # CUDA context, cuBLAS/NCCL workspaces, the caching allocator's slack
ENGINE_RUNTIME_BYTES = 2.0 * GIB  # an engine's activations at its batch limit and CUDA graphs, over its weights


@dataclass(frozen=True)
class TrainerLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    weight_bytes: int = 2  # the training dtype: 2 (bf16 / fp16) or 4
    micro_batch_tokens: int = 4096  # rows the layers compute in one micro-batch (padding included)
    logit_rows: int = 4096  # rows of one micro-batch that need logits (the responses)
    micro_batches: int = 1  # per optimizer step and rank (the pipeline's in-flight bound)
    recompute: str = "none"  # "none", "selective" or "full" (Megatron's --recompute-granularity)
    snapshots: int = 0  # on-device copies of the weights (KL reference, teacher)
    value_head: bool = False  # the critic: one value per row instead of the vocabulary
    device: str = "cuda"  # "cpu": torch's CPU norms save one more hidden-sized tensor each


@dataclass
class RoleMemory:
    parts: dict[str, float] = field(default_factory=dict)  # bytes by what holds them
    overhead: float = 0.0

    @property
    def peak_bytes(self) -> float:
        return sum(self.parts.values()) + self.overhead


def _stages(shape: FlopShape, pp: int) -> list[list[bool]]:
    """Each pipeline stage's layers, True for an MoE layer: Megatron's even split, the dense layers first (as
    DeepSeek-V3 and Qwen3-MoE's `mlp_only_layers` place them)."""
    kinds = [False] * (shape.layers - shape.moe_layers) + [True] * shape.moe_layers
    per = math.ceil(shape.layers / pp)
    return [kinds[i * per:(i + 1) * per] for i in range(pp)]


def _linear_layers(shape: FlopShape, stage_layers: int) -> int:
    """How many of a stage's layers are Gated DeltaNet layers: they spread evenly over the stages (Qwen3-Next's and
    Qwen3.5's: three of every four layers)."""
    return round(shape.linear_layers * stage_layers / shape.layers)


def attention_parameters(shape: FlopShape, tp: int, linear: bool = False) -> float:
    """One layer's attention weights on a tensor-parallel rank (its two norms included); `linear`: a Gated DeltaNet
    layer's (in_proj, the convolution, A_log and dt_bias, the gated norm, out_proj)."""
    h = shape.hidden
    if linear:
        keys, values = shape.linear_key_heads * shape.linear_key_dim, shape.linear_value_heads * shape.linear_value_dim
        heads = shape.linear_value_heads
        return (h * (2 * keys + 2 * values + 2 * heads) + (2 * keys + values) * shape.linear_conv_kernel
                + 2 * heads + values * h) / tp + shape.linear_value_dim + 2 * h
    if shape.kv_lora_rank:  # multi-latent attention: the down projections are replicated over TP
        qk = shape.qk_nope_dim + shape.qk_rope_dim
        q = (h * shape.q_lora_rank + shape.q_lora_rank + shape.q_lora_rank * shape.heads * qk / tp) \
            if shape.q_lora_rank else h * shape.heads * qk / tp
        kv = h * (shape.kv_lora_rank + shape.qk_rope_dim) + shape.kv_lora_rank \
            + shape.kv_lora_rank * shape.heads * (shape.qk_nope_dim + shape.v_head_dim) / tp
        return q + kv + shape.heads * shape.v_head_dim * h / tp + 2 * h
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    gate = q if shape.output_gate else 0  # Qwen3-Next's q_proj also holds the output gate
    return h * (q + gate + 2 * kv) / tp + q * h / tp + 2 * h + 2 * shape.head_dim


def mlp_parameters(shape: FlopShape, moe: bool, layout: TrainerLayout) -> float:
    h = shape.hidden
    if not moe:
        return 3 * h * shape.ffn / layout.tp
    experts = shape.num_experts / layout.ep * 3 * h * shape.moe_ffn / layout.etp
    gate = h if shape.output_gate and shape.shared_expert_ffn else 0  # Qwen3-Next's shared expert's gate
    return h * shape.num_experts + experts + 3 * h * shape.shared_expert_ffn / layout.tp + gate


def stage_parameters(shape: FlopShape, layout: TrainerLayout, stage: int, tied: bool) -> float:
    """Weights on one rank of pipeline stage `stage`: its layers, the embedding on the first stage, the final norm
    and output layer (or value head) on the last (a tied output layer is the embedding when both are one stage)."""
    stages = _stages(shape, layout.pp)
    linear = _linear_layers(shape, len(stages[stage]))
    total = sum(mlp_parameters(shape, moe, layout) for moe in stages[stage]) \
        + linear * attention_parameters(shape, layout.tp, linear=True) \
        + (len(stages[stage]) - linear) * attention_parameters(shape, layout.tp)
    if shape.lora_rank:
        total += lora_parameters(shape, stages[stage], layout.tp)
    last = stage == layout.pp - 1
    if stage == 0:
        total += shape.vocab * shape.hidden / layout.tp
    if last:
        total += shape.hidden
        if layout.value_head:
            total += shape.hidden
        elif not (tied and layout.pp == 1):
            total += shape.vocab * shape.hidden / layout.tp
    return total


def lora_parameters(shape: FlopShape, layers: list[bool], tp: int) -> float:
    """The adapters of `layers` (every linear map of attention and MLP, as FlopShape counts them)."""
    count = 0.0
    for moe in layers:
        for n_in, n_out, times in shape._linears(moe):
            if n_out != shape.num_experts:
                count += times * shape.lora_rank * (n_in + n_out) / tp
    return count


def layer_activation_elements(shape: FlopShape, moe: bool, layout: TrainerLayout, linear: bool = False) -> float:
    """Elements autograd keeps per token for one layer's backward (vime's local spec, measured by module), in the
    training dtype's width; `linear`: a Gated DeltaNet layer's token mixer instead of attention."""
    h, tp = shape.hidden, layout.tp
    hidden_share = tp if layout.sequence_parallel else 1
    norm_extra = 1 if layout.device == "cpu" else 0  # torch's CPU RMSNorm keeps x * rstd; the fused kernel not
    # the two norms' inputs and outputs, the residual
    total = (4 + 2 * norm_extra) * h / hidden_share
    if linear:
        total += linear_attention_elements(shape, layout)
    elif shape.kv_lora_rank:
        qk = shape.qk_nope_dim + shape.qk_rope_dim
        heads_qk, heads_v = shape.heads * qk, shape.heads * shape.v_head_dim
        total += 2 * (shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_dim)  # latents, replicated
        total += (4 * heads_qk + 4 * heads_v + shape.heads * (shape.qk_nope_dim + shape.v_head_dim)) / tp
    else:
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        # qkv, the rotated q / k, the kernel's own [b, heads, s, d] q, k, v and its output, the projection's input
        # (the q / k norms' intermediate on CPU)
        total += ((5 + norm_extra) * q + (5 + norm_extra) * kv) / tp
    if not moe:
        return total + 5 * shape.ffn / tp  # fc1's output, the SwiGLU halves and product, fc2's input
    k = shape.experts_per_token  # the permuted tokens, the router's scores, each routed copy's expert MLP
    routed = (k * h + 8 * shape.num_experts + 6 * k * shape.moe_ffn / layout.etp) / hidden_share
    return total + routed + 5 * shape.shared_expert_ffn / tp


def linear_attention_elements(shape: FlopShape, layout: TrainerLayout) -> float:
    """What a Gated DeltaNet mixer (`trainer.megatron.linear_attention`) keeps per token, in the training dtype's
    width. Fitted to its saved tensors measured on this CPU over seven head layouts (within 1.5% of each layer's):
    in the training dtype, in_proj's output, the convolution's and its SiLU's (6 x keys + 5 x values, keys and
    values being the key and value heads' widths); in float32 (the rule computes in it), the normalised and
    per-value-head repeated q and k with their chunked copies (8 x value heads x key dim), the rule's right-hand
    sides, solutions and outputs, the gated norm (7 x values), its 64 x 64 matrices of each chunk (6 x value heads x
    64) and the recurrent state each chunk starts from (value heads x key dim x value dim / 64)."""
    from vime.trainer.megatron.gated_delta_rule import CHUNK

    keys, values = shape.linear_key_heads * shape.linear_key_dim, shape.linear_value_heads * shape.linear_value_dim
    heads = shape.linear_value_heads
    in_dtype = 6 * keys + 5 * values
    in_fp32 = 7 * values + heads * (8 * shape.linear_key_dim + 6 * CHUNK
                                    + shape.linear_key_dim * shape.linear_value_dim / CHUNK)
    return (in_dtype + in_fp32 * FP32 / layout.weight_bytes) / layout.tp


def activation_bytes(shape: FlopShape, layout: TrainerLayout, stage: int) -> float:
    """The activations one rank of `stage` holds at its peak: the micro-batches in flight on it (1F1B: the first
    stage up to `pp`), each with its layers' saved tensors, or under full recompute each layer's input and one
    layer's saved tensors while it is recomputed."""
    layers = _stages(shape, layout.pp)[stage]
    linear = _linear_layers(shape, len(layers))
    per_token = [layer_activation_elements(shape, moe, layout, linear=i < linear) for i, moe in enumerate(layers)]
    in_flight = min(layout.pp - stage, layout.micro_batches)
    embedding = shape.hidden if stage == 0 else 0
    if layout.recompute == "full":  # each micro-batch in flight keeps its layer inputs; one layer is recomputed
        hidden_share = layout.tp if layout.sequence_parallel else 1
        elements = in_flight * (len(layers) * shape.hidden / hidden_share + embedding) + max(per_token, default=0.0)
    else:
        elements = in_flight * (sum(per_token) + embedding)
    return elements * layout.micro_batch_tokens * layout.weight_bytes


def logits_bytes(shape: FlopShape, layout: TrainerLayout) -> float:
    """The last stage's logits for one micro-batch's response rows and what the log-prob computation holds over
    them: float32 logits and their saved log-softmax; 16-bit logits (or float32 ones of 2^28 elements and more),
    the logits and their gradient in their own dtype plus float32 chunks (`trainer.log_probs`)."""
    if layout.value_head:
        return 0.0
    elements = layout.logit_rows * shape.vocab / layout.tp
    final_norm = (2 if layout.device == "cpu" else 1) * shape.hidden * layout.micro_batch_tokens * layout.weight_bytes
    if layout.weight_bytes < FP32 or elements >= WHOLE_BLOCK_LIMIT:
        return final_norm + 2 * elements * layout.weight_bytes + CHUNK_COPIES * LOG_PROB_CHUNK_ELEMENTS * FP32
    return final_norm + 2 * elements * FP32


def trainer_memory(shape: FlopShape, layout: TrainerLayout, tied: bool = False) -> RoleMemory:
    """The most memory any rank of the trainer holds: the peak over its pipeline stages."""
    return max((trainer_stage_memory(shape, layout, s, tied) for s in range(layout.pp)), key=lambda m: m.peak_bytes)


def expert_data_parallel(layout: TrainerLayout) -> int:
    """The ranks that hold the same experts (Megatron's expert data-parallel group): the distributed optimizer
    shards the experts' state over these, the rest over the data-parallel ranks."""
    return max(layout.dp * layout.tp // (layout.ep * layout.etp), 1)


def trainer_stage_memory(shape: FlopShape, layout: TrainerLayout, stage: int, tied: bool = False) -> RoleMemory:
    params = stage_parameters(shape, layout, stage, tied)
    layers = _stages(shape, layout.pp)[stage]
    trainable = lora_parameters(shape, layers, layout.tp) if shape.lora_rank else params
    master = FP32 if layout.weight_bytes < FP32 else 0
    experts = 0.0 if shape.lora_rank else \
        sum(layers) * shape.num_experts / layout.ep * 3 * shape.hidden * shape.moe_ffn / layout.etp
    shards = (layout.dp, expert_data_parallel(layout)) if layout.distributed_optimizer else (1, 1)
    optimizer = ((trainable - experts) / shards[0] + experts / shards[1]) * (2 * FP32 + master)
    snapshot = trainable if shape.lora_rank else params  # a LoRA reference is its starting adapters
    parts = {"weights": params * layout.weight_bytes, "gradients": trainable * FP32, "optimizer": optimizer,
             "snapshots": layout.snapshots * snapshot * layout.weight_bytes,
             "activations": activation_bytes(shape, layout, stage),
             "logits": logits_bytes(shape, layout) if stage == layout.pp - 1 else 0.0}
    return RoleMemory(parts, CUDA_OVERHEAD_BYTES if layout.device == "cuda" else 0.0)


@dataclass(frozen=True)
class EngineLayout:
    tp: int = 1
    weight_bytes: int = 2
    kv_bytes: int = 2  # --vllm-kv-cache-dtype: 1 for fp8
    memory_utilization: float = 0.92
    max_model_len: int = 4096


def kv_bytes_per_token(shape: FlopShape, engine: EngineLayout) -> float:
    """KV cache bytes of one token on one engine rank: keys and values of every layer (MLA: the latent and the
    rotary key, replicated over TP)."""
    if shape.kv_lora_rank:
        return shape.layers * (shape.kv_lora_rank + shape.qk_rope_dim) * engine.kv_bytes
    return shape.layers * 2 * max(shape.kv_heads // engine.tp, 1) * shape.head_dim * engine.kv_bytes


def engine_memory(shape: FlopShape, engine: EngineLayout, gpu_bytes: float, tied: bool = False) -> dict:
    """One engine rank: its weights, the KV cache vLLM fills up to its memory utilization, and whether that cache
    holds one sequence of --vllm-max-model-len (vLLM refuses to start otherwise)."""
    whole = stage_parameters(shape, TrainerLayout(tp=1, pp=1), 0, tied)
    weights = whole / engine.tp * engine.weight_bytes
    budget = engine.memory_utilization * gpu_bytes
    kv_cache = budget - weights - ENGINE_RUNTIME_BYTES
    per_token = kv_bytes_per_token(shape, engine)
    tokens = max(kv_cache, 0) / per_token
    return {"weights": weights, "runtime": ENGINE_RUNTIME_BYTES, "kv_cache": max(kv_cache, 0.0),
            "kv_cache_tokens": int(tokens), "peak": budget,
            "fits": kv_cache > 0 and tokens >= engine.max_model_len}
