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

from vime.trainer.megatron.hf_architecture import (MTP_FAMILIES, hf_architecture, language_config,
                                                   multi_token_prediction_layers)
from vime.trainer.megatron.megatron_flags import (add_generated_megatron_args, check_megatron_lm_architecture,
                                                         core_flag, flag_name, warn_once)
from vime.config.section import add_flags
from vime.config.train import LoraConfig, MegatronConfig
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
    for title, part in (("Megatron parallelism and batch", "parallelism"), ("Megatron optimizer", None),
                        ("Megatron precision and regularisation", "precision"),
                        ("Megatron mixture of experts", "moe"), ("Megatron multi-token prediction", "mtp"),
                        ("Megatron checkpoints", "checkpoints")):
        add_flags(parser.add_argument_group(title), MegatronConfig, part=part)
    g = parser.add_argument_group(
        "Megatron model architecture", "Each flag defaults to None = read from the --hf-checkpoint config.json; "
        "a value given that contradicts the config is an error.")
    add_flags(g, MegatronConfig, part="architecture")
    add_generated_megatron_args(parser)
    return parser


def fill_architecture_from_hf(args: argparse.Namespace, hf_config) -> argparse.Namespace:
    """A copy of `args` with each architecture flag left None taken from `hf_config`; the given ones are checked
    against it.

    Raises ValueError naming the flag, the given and the config value when a given flag contradicts the config
    (e.g. `--num-layers 4` for a 2-layer checkpoint).
    """
    megatron = MegatronConfig.of(args)
    check_megatron_lm_architecture(args)
    filled = {}
    architecture = hf_architecture(hf_config)
    for dest, value in architecture.items():
        if dest == "moe_router_pre_softmax" and architecture["moe_router_score_function"] == "sigmoid":
            continue  # Megatron reads it for softmax scores only; slime's GLM-4.5 and DeepSeek-V3 scripts pass it
        given = getattr(megatron, dest) if dest in MEGATRON_FIELDS else core_flag(args, dest)
        if dest == "moe_layer_freq" and isinstance(given, int):  # Megatron-LM's "every N-th layer, from 0"
            given = [int(i % given == 0) for i in range(language_config(hf_config).num_hidden_layers)]
        if given is None:
            filled[dest] = value
        elif given != value:
            flag = flag_name(dest)
            raise ValueError(f"{flag}={given!r} contradicts the HF config, which gives {value!r}; "
                             f"drop {flag} to use the config's value")
    if args.use_gated_attention and not architecture["attention_output_gate"]:  # slime's flag, checked
        raise ValueError("--use-gated-attention contradicts the HF config, whose attention has no output gate; "
                         "drop --use-gated-attention")
    _check_mtp(args, hf_config)
    if megatron.moe_aux_loss_coeff is None:  # a training choice: the config's is only the default
        filled["moe_aux_loss_coeff"] = float(getattr(language_config(hf_config), "router_aux_loss_coef", 0.0) or 0.0)
    return with_values(args, **filled)


def _check_mtp(args: argparse.Namespace, hf_config) -> None:
    """The multi-token-prediction flags against the checkpoint and the layouts vime's MTP layers support."""
    megatron = MegatronConfig.of(args)
    if megatron.enable_mtp_training and not megatron.mtp_num_layers:
        raise ValueError("--enable-mtp-training needs --mtp-num-layers N: the MTP layers to train")
    if not megatron.mtp_num_layers:
        return
    model_type, declared = language_config(hf_config).model_type, multi_token_prediction_layers(hf_config)
    if model_type not in MTP_FAMILIES:
        raise ValueError(f"--mtp-num-layers {megatron.mtp_num_layers}: vime reads MTP layers from "
                         f"{', '.join(MTP_FAMILIES)} checkpoints, not {model_type}; drop --mtp-num-layers")
    if megatron.mtp_num_layers > declared:
        raise ValueError(f"--mtp-num-layers {megatron.mtp_num_layers}: the checkpoint declares {declared} MTP "
                         f"layer(s); use at most {declared}")
    unsupported = [f for f, on in (("--pipeline-model-parallel-size > 1", megatron.pipeline_model_parallel_size > 1),
                                   ("--sequence-parallel", core_flag(args, "sequence_parallel")),
                                   ("--lora-rank", LoraConfig.of(args).lora_rank)) if on]
    if unsupported:
        raise ValueError(f"--mtp-num-layers with {unsupported[0]} is not supported yet; drop one of them")


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
