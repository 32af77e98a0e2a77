"""Megatron-style training flags, the architecture read from an HF config, and their validation.

The pip package `megatron-core` has no `megatron.training`, so vime declares the Megatron-LM flags it uses
itself, with Megatron's names, so that Megatron users' scripts read the same. `--seed` lives in vime's run
flags (`vime.arguments`).

Architecture flags default to None: `fill_architecture_from_hf(args, hf_config)` fills each one left None
from the HF config, and refuses a given value that contradicts the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from vime.trainer.megatron.hf_architecture import hf_architecture
from vime.trainer.megatron.megatron_flags import (add_generated_megatron_args, check_megatron_lm_architecture,
                                                         core_flag, warn_once)
from vime.config.section import apply_defaults
from vime.config.train import MegatronConfig
from vime.utils.device import use_gpu
from vime.utils.misc import with_values

# Architecture flags (argparse dest names) that `hf_architecture` reads from an HF config.
ARCHITECTURE_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "rotary_base", "norm_epsilon", "vocab_size", "untie_embeddings_and_output_weights", "max_position_embeddings",
    "qk_layernorm", "add_qkv_bias",
)

MEGATRON_FIELDS = frozenset(f.name for f in dataclasses.fields(MegatronConfig))


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Megatron-LM flags vime uses (parallelism, batch, optimizer, precision, checkpoint, model)."""
    g = parser.add_argument_group("Megatron parallelism and batch")
    g.add_argument("--tensor-model-parallel-size", type=int,
                   help="Tensor-parallel size: ranks that split each layer's matrices (default: %(default)s).")
    g.add_argument("--pipeline-model-parallel-size", type=int,
                   help="Pipeline-parallel size: ranks that split the layers into stages (default: %(default)s).")
    g.add_argument("--micro-batch-size", type=int,
                   help="Sequences per micro-batch per data-parallel rank (default: %(default)s).")
    g.add_argument("--global-batch-size", type=int,
                   help="Sequences per optimizer step over all data-parallel ranks; a multiple of "
                        "micro-batch-size x data-parallel size (default: None = micro-batch-size x DP size).")

    g.add_argument("--expert-model-parallel-size", type=int,
                   help="Expert-parallel size (MoE): ranks that split each MoE layer's experts, carved from the "
                        "data-parallel ranks (default: %(default)s).")
    g.add_argument("--expert-tensor-parallel-size", type=int,
                   help="Tensor-parallel size inside each expert (default: None = --tensor-model-parallel-size).")

    g.add_argument("--qkv-format", choices=["thd", "bshd"],
                   help="Micro-batch layout: thd = the sequences packed one after another without padding (each "
                        "attends only to itself); bshd = right-padded to the longest (default: %(default)s).")

    g = parser.add_argument_group("Megatron optimizer")
    g.add_argument("--lr", type=float, help="Peak learning rate (default: 1e-6).")
    g.add_argument("--min-lr", type=float, help="Learning rate at the end of decay (default: %(default)s).")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"],
                   help="Learning-rate decay after warmup (default: %(default)s).")
    g.add_argument("--lr-warmup-iters", type=int,
                   help="Optimizer steps of linear warmup from 0 to --lr (default: %(default)s).")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay (default: %(default)s).")
    g.add_argument("--adam-beta1", type=float, help="Adam beta1 (default: %(default)s).")
    g.add_argument("--adam-beta2", type=float, help="Adam beta2 (default: %(default)s).")
    g.add_argument("--adam-eps", type=float, help="Adam epsilon (default: 1e-8).")
    g.add_argument("--clip-grad", type=float,
                   help="Clip the global gradient L2 norm to this value; 0 disables (default: %(default)s).")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer states over data-parallel ranks (default: off).")

    g = parser.add_argument_group("Megatron precision and regularisation")
    g.add_argument("--bf16", action="store_true",
                   help="bfloat16 parameters and compute on GPU; ignored on CPU, which trains in float32 "
                        "(default: off).")
    g.add_argument("--fp16", action="store_true",
                   help="float16 parameters and compute on GPU; ignored on CPU (default: off).")
    g.add_argument("--attention-dropout", type=float,
                   help="Dropout on attention probabilities (default: 0.0; Megatron-LM's is 0.1, but RL needs "
                        "the trainer's log-probs to match the rollout engine's).")
    g.add_argument("--hidden-dropout", type=float,
                   help="Dropout on hidden states (default: 0.0; Megatron-LM's is 0.1).")

    g = parser.add_argument_group("Megatron mixture of experts")
    g.add_argument("--moe-router-load-balancing-type",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "none"],
                   help="Load-balancing loss of the router (default: aux_loss, weighted by --moe-aux-loss-coeff).")
    g.add_argument("--moe-aux-loss-coeff", type=float,
                   help="Weight of the load-balancing loss (default: None = the HF config's router_aux_loss_coef, "
                        "else 0).")
    g.add_argument("--moe-z-loss-coeff", type=float, help="Weight of the router z-loss (default: None = off).")
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall"],
                   help="How tokens reach their experts (default: alltoall, the dispatcher that takes RL's "
                        "variable-length micro-batches).")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="Grouped GEMM for the experts (GPU with TransformerEngine; default: off = one GEMM per "
                        "expert).")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"],
                   help="Precision of the router's logits and probabilities (default: %(default)s).")
    g.add_argument("--moe-router-bias-update-rate", type=float,
                   help="Step of the expert-bias update after each optimizer step (aux-loss-free load balancing, "
                        "models with an expert bias such as DeepSeek-V3; the bias goes to the engines with the "
                        "weights; 0 freezes it; default: 1e-3, Megatron-LM's).")

    g = parser.add_argument_group("Megatron checkpoints")
    g.add_argument("--load",
                   help="torch_dist checkpoint directory to resume from (default: None = start from "
                        "--hf-checkpoint).")
    g.add_argument("--ref-load",
                   help="slime's reference checkpoint (torch_dist, as scripts/convert_hf_to_torch_dist.py writes it, "
                        "or an HF directory): the KL reference of --use-kl-loss / --kl-coef, and the actor's first "
                        "weights when --load holds no checkpoint (default: None = the reference is the actor's "
                        "first weights).")
    g.add_argument("--save", help="Directory for torch_dist checkpoints (default: None = no saving).")
    g.add_argument("--save-interval", type=int, help="Save every this many rollouts (default: None = only at the end).")
    g.add_argument("--save-retain", type=int,
                   help="Keep only the newest this many checkpoints in --save, never the one a resume starts "
                        "from (default: None = keep all).")
    g.add_argument("--no-load-optim", action="store_true",
                   help="Do not load optimizer state from --load (default: off).")
    g.add_argument("--no-load-rng", action="store_true", help="Do not load RNG state from --load (default: off).")
    g.add_argument("--finetune", action="store_true",
                   help="Load only the weights from --load and restart the iteration count at 0 (default: off).")

    g = parser.add_argument_group(
        "Megatron model architecture", "Each flag defaults to None = read from the --hf-checkpoint config.json; "
        "a value given that contradicts the config is an error.")
    for flag, kind, what in (
        ("--num-layers", int, "Transformer layers (num_hidden_layers)"),
        ("--hidden-size", int, "Hidden size (hidden_size)"),
        ("--ffn-hidden-size", int, "MLP intermediate size (intermediate_size)"),
        ("--num-attention-heads", int, "Query heads (num_attention_heads)"),
        ("--num-query-groups", int, "Key/value heads for grouped-query attention (num_key_value_heads)"),
        ("--kv-channels", int, "Per-head dimension (head_dim)"),
        ("--rotary-base", float, "RoPE theta (rope_parameters.rope_theta)"),
        ("--norm-epsilon", float, "RMSNorm epsilon (rms_norm_eps)"),
        ("--vocab-size", int, "Vocabulary size of the embedding and output layer (vocab_size)"),
        ("--max-position-embeddings", int, "Longest sequence for position embeddings (max_position_embeddings)"),
    ):
        g.add_argument(flag, type=kind, help=f"{what} (default: None = from the HF config).")
    g.add_argument("--num-experts", type=int,
                   help="Routed experts per MoE layer (num_experts; default: None = from the HF config, none for "
                        "dense models).")
    g.add_argument("--moe-router-topk", type=int,
                   help="Experts each token is routed to (num_experts_per_tok; default: None = from the HF config).")
    g.add_argument("--moe-ffn-hidden-size", type=int,
                   help="Hidden size of each expert's MLP (moe_intermediate_size; default: None = from the HF "
                        "config).")
    g.add_argument("--moe-layer-freq", type=_layer_pattern,
                   help="Which layers are MoE: N (layers 0, N, 2N, ...) or a JSON list of 0/1 per layer "
                        "(decoder_sparse_step and mlp_only_layers; default: None = from the HF config).")
    for flag, kind, what in (
        ("--moe-router-score-function", str, "Router scores: softmax or sigmoid (scoring_func)"),
        ("--moe-router-num-groups", int, "Expert groups of group-limited routing (n_group)"),
        ("--moe-router-group-topk", int, "Groups each token may route into (topk_group)"),
        ("--moe-router-topk-scaling-factor", float, "Scale of the routing weights (routed_scaling_factor)"),
        ("--moe-shared-expert-intermediate-size", int, "Hidden size of the shared experts, all of them together "
                                                       "(n_shared_experts x moe_intermediate_size)"),
        ("--q-lora-rank", int, "Multi-latent attention: rank of the query compression (q_lora_rank)"),
        ("--kv-lora-rank", int, "Multi-latent attention: rank of the key/value latent (kv_lora_rank)"),
        ("--qk-head-dim", int, "Multi-latent attention: query/key head size without position (qk_nope_head_dim)"),
        ("--qk-pos-emb-head-dim", int, "Multi-latent attention: rotary part of the query/key heads "
                                       "(qk_rope_head_dim)"),
        ("--v-head-dim", int, "Multi-latent attention: value head size (v_head_dim)"),
    ):
        g.add_argument(flag, type=kind, help=f"{what} (default: None = from the HF config).")
    g.add_argument("--rope-scaling-factor", type=float,
                   help="Llama 3.x RoPE scaling factor (rope_scaling.factor; default: None = from the HF config).")
    for flag, what in (
        ("--use-rope-scaling", "Llama 3.x RoPE frequency scaling (rope_scaling.rope_type llama3)"),
        ("--untie-embeddings-and-output-weights", "Separate output layer, not tied to the embedding "
                                                  "(not tie_word_embeddings)"),
        ("--qk-layernorm", "RMSNorm on queries and keys per head (Qwen3)"),
        ("--add-qkv-bias", "Bias on the query/key/value projection (Qwen2)"),
        ("--multi-latent-attention", "Multi-latent attention (DeepSeek-V3)"),
        ("--moe-router-enable-expert-bias", "Expert bias in the routing choice (e_score_correction_bias, "
                                            "DeepSeek-V3's topk_method noaux_tc)"),
    ):
        g.add_argument(flag, action="store_true", help=f"{what} (default: None = from the HF config).")
    add_generated_megatron_args(parser)
    apply_defaults(parser, MegatronConfig)  # defaults: vime/config
    return parser


def _layer_pattern(text: str) -> list[int]:
    """--moe-layer-freq: "N" (every N-th layer is MoE, counting from 1) is kept as N; "[0, 1, 1]" as a list."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a JSON list of 0/1") from e
    if isinstance(value, int) or (isinstance(value, list) and all(v in (0, 1) for v in value)):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a JSON list of 0/1")


def fill_architecture_from_hf(args: argparse.Namespace, hf_config) -> argparse.Namespace:
    """A copy of `args` with each architecture flag left None taken from `hf_config`; the given ones are checked
    against it.

    Raises ValueError naming the flag, the given and the config value when a given flag contradicts the config
    (e.g. `--num-layers 4` for a 2-layer checkpoint).
    """
    megatron = MegatronConfig.of(args)
    check_megatron_lm_architecture(args)
    filled = {}
    for dest, value in hf_architecture(hf_config).items():
        given = getattr(megatron, dest) if dest in MEGATRON_FIELDS else core_flag(args, dest)
        if dest == "moe_layer_freq" and isinstance(given, int):  # Megatron-LM's "every N-th layer, from 0"
            given = [int(i % given == 0) for i in range(hf_config.num_hidden_layers)]
        if given is None:
            filled[dest] = value
        elif given != value:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag}={given!r} contradicts the HF config, which gives {value!r}; "
                             f"drop {flag} to use the config's value")
    if megatron.moe_aux_loss_coeff is None:  # a training choice: the config's is only the default
        filled["moe_aux_loss_coeff"] = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    return with_values(args, **filled)


def validate_megatron_args(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Check parallel sizes, batch sizes and the architecture against each other; fill global batch size.

    `world_size` is the number of training ranks (default: tensor x pipeline size, i.e. DP=1). Call after
    `fill_architecture_from_hf`. Raises ValueError with a suggested fix; returns a copy of `args` with
    --global-batch-size set (one micro-batch per data-parallel rank when not given).
    """
    megatron = MegatronConfig.of(args)
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) must be >= 1")
    world_size = tp * pp if world_size is None else world_size
    if world_size % (tp * pp):
        raise ValueError(f"{world_size} training ranks are not a multiple of tensor x pipeline parallel size "
                         f"({tp} x {pp}); change the number of training GPUs/processes or the parallel sizes")
    dp = world_size // (tp * pp)
    if megatron.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {megatron.micro_batch_size}")
    gbs = megatron.micro_batch_size * dp if megatron.global_batch_size is None else megatron.global_batch_size
    if gbs % (megatron.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
                         f"x data-parallel size = {megatron.micro_batch_size} x {dp}; e.g. use --global-batch-size "
                         f"{(gbs // (megatron.micro_batch_size * dp) + 1) * megatron.micro_batch_size * dp}")
    if megatron.bf16 and megatron.fp16:
        raise ValueError("--bf16 and --fp16 are exclusive; pass one of them")
    if core_flag(args, "sequence_parallel") and tp == 1:
        raise ValueError("--sequence-parallel splits activations over tensor-parallel ranks: it needs "
                         "--tensor-model-parallel-size > 1; drop it or raise the tensor-parallel size")
    if (core_flag(args, "context_parallel_size") or 1) > 1:
        raise ValueError(f"--context-parallel-size {core_flag(args, 'context_parallel_size')}: context parallelism "
                         "is not "
                         "supported by vime's trainer yet; use 1 (sequences are split over micro-batches instead)")
    if (megatron.bf16 or megatron.fp16) and not use_gpu():
        warn_once(f"{'--bf16' if megatron.bf16 else '--fp16'} on CPU: the trainer computes in float32 (16-bit float "
                  "math is several times slower on CPU)")
    if megatron.min_lr > megatron.lr:
        raise ValueError(f"--min-lr {megatron.min_lr} is above --lr {megatron.lr}; lower --min-lr")

    missing = [d for d in ARCHITECTURE_FLAGS if getattr(megatron, d) is None]
    if missing:
        raise ValueError(f"architecture flags not set: {missing}; call fill_architecture_from_hf first")
    for dest, what in (("num_attention_heads", "attention heads"), ("ffn_hidden_size", "MLP hidden size"),
                       ("vocab_size", "vocabulary size")):
        value = getattr(megatron, dest)
        if value % tp:
            raise ValueError(f"{what} ({value}, --{dest.replace('_', '-')}) is not divisible by "
                             f"--tensor-model-parallel-size {tp}; choose a tensor-parallel size that divides it")
    groups = megatron.num_query_groups
    if groups % tp and tp % groups:
        raise ValueError(f"key/value heads ({groups}) and --tensor-model-parallel-size {tp}: one must divide the "
                         f"other; choose a tensor-parallel size that divides {groups} or is a multiple of it")
    if megatron.num_layers % pp:
        raise ValueError(f"{megatron.num_layers} layers are not divisible by --pipeline-model-parallel-size {pp}; "
                         f"choose a pipeline size that divides the layer count")
    _check_moe(args, world_size)
    return with_values(args, global_batch_size=gbs)


def _check_moe(args: argparse.Namespace, world_size: int) -> None:
    megatron = MegatronConfig.of(args)
    ep = megatron.expert_model_parallel_size
    etp = megatron.expert_tensor_parallel_size or megatron.tensor_model_parallel_size
    experts = megatron.num_experts
    if ep < 1 or etp < 1:
        raise ValueError(f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) must be >= 1")
    if not experts:  # no experts to split: --expert-tensor-parallel-size (slime's dense scripts set 1) is moot
        if ep > 1:
            raise ValueError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model; this one is dense")
        return
    if experts % ep:
        raise ValueError(f"{experts} experts do not split over --expert-model-parallel-size {ep}; choose a size that "
                         "divides the expert count")
    per_stage = world_size // megatron.pipeline_model_parallel_size
    if per_stage % (ep * etp):
        raise ValueError(f"{per_stage} ranks per pipeline stage are not a multiple of expert-parallel x "
                         f"expert-tensor-parallel size ({ep} x {etp}); add training ranks or lower the sizes")
    if megatron.moe_grouped_gemm:
        if not use_gpu():  # slime's MoE scripts set it: the same math, one GEMM per expert (model_provider)
            warn_once("--moe-grouped-gemm on CPU: one GEMM per expert instead (the same result); grouped GEMM needs "
                      "a GPU with TransformerEngine")
