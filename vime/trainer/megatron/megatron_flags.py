"""Megatron-LM's training flags, generated from megatron-core's config dataclasses.

The pip package `megatron-core` ships no argument parser, but it ships the dataclasses that Megatron-LM's flags
fill: `TransformerConfig` (with `MLATransformerConfig`'s fields), `OptimizerConfig` and
`DistributedDataParallelConfig`. Every field of theirs is reachable by a flag, like vime's `--vllm-*` flags come
from vLLM's own definitions:

- `--<field-name>` (underscores as dashes), or Megatron-LM's own name where it differs (`MEGATRON_LM_NAMES`);
  type, choices and help text from the dataclass (its field docstrings), the dataclass default in the help;
- a field vime declares itself (a `flag()` field of `MegatronConfig` in vime/config/train.py: vime's defaults, the
  architecture read from the HF config) keeps that flag (`HAND_DECLARED`);
- a field vime sets itself is listed in `FIXED`, with the reason, and has no flag.

Generated flags default to None ("not given"): `given_fields(args, config_class)` is what a launch script set for
one dataclass, applied over vime's own values where the configs are built (`model_provider`, `model`). A field
two dataclasses share (`use_distributed_optimizer`, `overlap_param_gather`, ...) is one flag that reaches both.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib.util
import inspect
import logging
import textwrap
import typing
from pathlib import Path
from typing import Literal, Union

from vime.utils.option_cache import cache_path, cached_table

logger = logging.getLogger(__name__)

# field -> Megatron-LM's flag, where its name is not the field's; "!" marks a flag that stores the negation
MEGATRON_LM_NAMES = {
    "layernorm_zero_centered_gamma": "--apply-layernorm-1p",  # slime's Qwen3-Next / Qwen3.5 scripts pass it
    "grad_reduce_in_fp32": "--accumulate-allreduce-grads-in-fp32",
    "bucket_size": "--ddp-bucket-size",
    "average_in_collective": "--ddp-average-in-collective",
    "check_for_nan_in_grad": "--check-for-nan-in-loss-and-grad",
    "apply_rope_fusion": "!--no-rope-fusion",
    "masked_softmax_fusion": "!--no-masked-softmax-fusion",
    "bias_activation_fusion": "!--no-bias-swiglu-fusion",
    "bias_dropout_fusion": "!--no-bias-dropout-fusion",
    "persist_layer_norm": "!--no-persist-layer-norm",
    "gradient_accumulation_fusion": "!--no-gradient-accumulation-fusion",
    "gated_linear_unit": "--swiglu",
    "add_bias_linear": "!--disable-bias-linear",
}

# field -> the dest of vime's own flag that sets it (`MegatronConfig`'s, vime/config/train.py)
HAND_DECLARED = {
    "num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads", "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels", "layernorm_epsilon": "norm_epsilon", "rotary_base": "rotary_base",
    "qk_layernorm": "qk_layernorm", "add_qkv_bias": "add_qkv_bias", "multi_latent_attention": "multi_latent_attention",
    "tensor_model_parallel_size": "tensor_model_parallel_size",
    "pipeline_model_parallel_size": "pipeline_model_parallel_size",
    "expert_model_parallel_size": "expert_model_parallel_size",
    "expert_tensor_parallel_size": "expert_tensor_parallel_size",
    "attention_dropout": "attention_dropout", "hidden_dropout": "hidden_dropout", "bf16": "bf16", "fp16": "fp16",
    "lr": "lr", "min_lr": "min_lr", "weight_decay": "weight_decay", "adam_beta1": "adam_beta1",
    "adam_beta2": "adam_beta2", "adam_eps": "adam_eps", "clip_grad": "clip_grad",
    "use_distributed_optimizer": "use_distributed_optimizer",
    "num_moe_experts": "num_experts", "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size", "moe_layer_freq": "moe_layer_freq",
    "moe_router_score_function": "moe_router_score_function", "moe_router_num_groups": "moe_router_num_groups",
    "moe_router_group_topk": "moe_router_group_topk",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate": "moe_router_bias_update_rate",
    "moe_router_load_balancing_type": "moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff", "moe_z_loss_coeff": "moe_z_loss_coeff",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type", "moe_grouped_gemm": "moe_grouped_gemm",
    "moe_router_dtype": "moe_router_dtype", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_head_dim": "qk_head_dim", "qk_pos_emb_head_dim": "qk_pos_emb_head_dim", "v_head_dim": "v_head_dim",
    "mtp_num_layers": "mtp_num_layers", "mtp_loss_scaling_factor": "mtp_loss_scaling_factor",  # vime's MTP layers
    "normalization": "normalization",  # RMSNorm, what the HF models vime loads use: the flag is checked against it
}

_OBJECT = "a Python object, not a command-line value"
_ROPE = "the rotary embedding is read from the HF config (rope_parameters / rope_scaling)"
FIXED = {
    # set by vime from other flags or from the device
    "params_dtype": "from --bf16 / --fp16 and the device (float32 on CPU)",
    "pipeline_dtype": "the parameters' dtype (--bf16 / --fp16)",
    "autocast_dtype": "the parameters' dtype (--bf16 / --fp16)",
    "main_grads_dtype": "float32 (Megatron's default); vime keeps gradients in float32",
    "main_params_dtype": "float32 (Megatron's default)",
    "exp_avg_dtype": "float32 (Megatron's default)",
    "exp_avg_sq_dtype": "float32 (Megatron's default)",
    "use_cpu_initialization": "by device: CPU initialisation on CPU, on the GPU otherwise",
    "variable_seq_lengths": "always on: RL micro-batches differ in length, so pipeline stages exchange shapes",
    "activation_func": "SiLU, with --swiglu (the HF models vime loads are SwiGLU models)",
    "transformer_impl": "local layers on every device; TransformerEngine's spec is not supported yet "
                        "(--transformer-impl is accepted without effect)",
    # Python objects Megatron's training loop wires up
    "timers": _OBJECT, "finalize_model_grads_func": _OBJECT + " (vime sets finalize_model_grads)",
    "grad_scale_func": _OBJECT + " (the optimizer's loss scale)", "no_sync_func": _OBJECT + " (DDP's no_sync)",
    "grad_sync_func": _OBJECT, "param_sync_func": _OBJECT, "_cpu_offloading_context": _OBJECT,
    "init_method": _OBJECT + "; weights come from the HF checkpoint", "output_layer_init_method": _OBJECT,
    "embedding_init_method": _OBJECT, "attention_backend": _OBJECT + " (an enum); vime picks SDPA or TE by device",
    "quant_recipe": _OBJECT,
    # structured values no flag of Megatron-LM's sets either
    "hierarchical_context_parallel_sizes": "context parallelism is not supported by vime's trainer",
    "pipeline_model_parallel_layout": "uneven pipeline layouts are not supported; layers split evenly",
    "window_size": "sliding-window attention: from the HF config when vime supports such a model",
    "window_attn_skip_freq": "sliding-window attention: from the HF config when vime supports such a model",
    "no_rope_freq": _ROPE, "mrope_section": _ROPE,
    "linear_attention_freq": "the hybrid layer pattern: read from the HF config's layer_types",
    "cp_comm_type": "context parallelism is not supported by vime's trainer",
    "cuda_graph_scope": "CUDA graphs are not used (variable sequence lengths)",
    "offload_modules": "activation offloading: vime offloads whole train states instead (--offload-train)",
    "config_logger_dir": "Megatron's config dump; vime writes <output-dir>/config.yaml",
}

# Megatron-LM flags with no field of their own that launch scripts carry: checked or accepted with their effect
ARCHITECTURE_ALIASES = {
    "--group-query-attention": "grouped-query attention: implied by --num-query-groups / the HF config",
    "--use-rotary-position-embeddings": "rotary position embeddings: the only kind vime's models use",
    "--use-gated-attention": "slime's gated attention (Qwen3-Next, Qwen3.5): the config's attention output gate",
}


# Flags of Megatron-LM and slime launch scripts that ask for what vime does anyway: accepted with a warning
ACCEPTED_WITHOUT_EFFECT = {
    "--attention-backend": (["flash", "fused", "unfused", "local", "auto"],
                            "vime picks the attention kernel: torch's SDPA (flash, memory-efficient or varlen on a "
                            "GPU)"),
    "--transformer-impl": (["local", "transformer_engine"],
                           "vime builds the local spec (torch layers) on every device; TransformerEngine's spec is "
                           "not supported yet"),
    "--use-mcore-models": (None, "vime always builds megatron-core models"),
    "--balance-data": (None, "vime always balances data-parallel ranks by tokens"),
    "--spec": ("MODULE FUNCTION", "slime's layer-spec provider: vime builds each layer's spec from the HF config "
                                  "(Qwen3-Next's and Qwen3.5's Gated DeltaNet layers included)"),
}


def _accepted_dest(flag: str) -> str:
    return "accepted_" + flag[2:].replace("-", "_")


def config_classes() -> dict[str, type]:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig

    return {"transformer": MLATransformerConfig, "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass and its bases (megatron-core documents fields that way)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, SyntaxError):
            continue
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _value_kind(annotation) -> dict | None:
    """argparse keywords for a field's type, or None when no command-line value fits it."""
    origin, params = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union and type(None) in params:
        inner = [p for p in params if p is not type(None)]
        if len(inner) != 1:
            return None
        return _value_kind(inner[0])
    if annotation is bool:
        return {"bool": True}
    if annotation in (int, float, str):
        return {"type": annotation}
    if origin is Literal and all(isinstance(p, str) for p in params):
        return {"type": str, "choices": list(params)}
    if origin in (list, typing.List) and len(params) == 1 and params[0] in (int, float, str):
        return {"type": params[0], "nargs": "+"}
    return None


_TABLE_FORMAT = 1  # part of the cache key: bump when the table's fields change
_CONFIG_SOURCES = ("transformer/transformer_config.py", "model_parallel_config.py", "optimizer/optimizer_config.py",
                   "distributed/distributed_data_parallel_config.py")


def megatron_option_table() -> list[dict]:
    """One dict per generated flag ("field", "owners", "flags", "action", "type", "nargs", "choices", "help"):
    from the cache when it holds the installed megatron-core's, else from its dataclasses (then cached), so that
    parsing a command line does not import megatron-core."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("megatron-core is not installed: pip install megatron-core==0.16.1")
    root = Path(next(iter(spec.submodule_search_locations)))
    sources = [root / s for s in _CONFIG_SOURCES] + [Path(__file__)]  # vime's tables here shape it too
    return cached_table(cache_path("megatron-config-options", sources, _TABLE_FORMAT), _build_option_table)


def _build_option_table() -> list[dict]:
    classes = config_classes()
    owners: dict[str, list[str]] = {}
    for key, cls in classes.items():
        for field in dataclasses.fields(cls):
            if field.name not in HAND_DECLARED and field.name not in FIXED:
                owners.setdefault(field.name, []).append(key)
    table = []
    for name, keys in sorted(owners.items()):
        cls = classes[keys[0]]
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        kind = _value_kind(typing.get_type_hints(cls)[name])
        if kind is None:
            raise TypeError(f"megatron-core {cls.__name__}.{name} ({field.type}) has no command-line form: add it to "
                            f"FIXED in {__name__} with the reason vime sets it")
        default = field.default if field.default is not dataclasses.MISSING else "(computed)"
        doc = _field_docs(cls).get(name, "")
        own = "--" + name.replace("_", "-")
        flag = MEGATRON_LM_NAMES.get(name, own)
        negated = flag.startswith("!")
        flags = [flag.lstrip("!")] + ([own] if own != flag.lstrip("!") and not negated else [])
        boolean = kind.pop("bool", False)
        table.append({"field": name, "owners": keys, "flags": flags,
                      "action": ("store_false" if negated else "store_true") if boolean else "store",
                      "type": kind["type"].__name__ if "type" in kind else None, "nargs": kind.get("nargs"),
                      "choices": kind.get("choices"),
                      "help": f"{doc} ({'/'.join(keys)} config; megatron-core default: {default!r})".strip()})
    return table


def generated_dests() -> set[str]:
    """The dests of the generated flags (megatron-core field names)."""
    return {option["field"] for option in megatron_option_table()}


_TYPES = {"int": int, "float": float, "str": str}


def add_generated_megatron_args(parser: argparse.ArgumentParser) -> None:
    """One flag per megatron-core config field not declared by hand nor fixed by vime, plus Megatron-LM's
    architecture flags that have no field."""
    g = parser.add_argument_group(
        "Megatron (generated from megatron-core's TransformerConfig, OptimizerConfig and "
        "DistributedDataParallelConfig)", "Each defaults to None = vime's choice, else megatron-core's default shown.")
    for option in megatron_option_table():
        extra = {} if option["action"] != "store" else {
            "type": _TYPES[option["type"]], "nargs": option["nargs"], "choices": option["choices"]}
        g.add_argument(*option["flags"], dest=option["field"], action=option["action"], default=None,
                       help=option["help"].replace("%", "%%"), **extra)
    for flag, what in ARCHITECTURE_ALIASES.items():
        g.add_argument(flag, action="store_true", default=None, help=f"Megatron-LM's flag for {what}.")
    for flag, (choices, what) in ACCEPTED_WITHOUT_EFFECT.items():
        kind = {"choices": choices} if isinstance(choices, list) else {"action": "store_true"}
        if isinstance(choices, str):  # values of their own (--spec MODULE FUNCTION)
            kind = {"nargs": len(choices.split()), "metavar": tuple(choices.split())}
        g.add_argument(flag, dest=_accepted_dest(flag), default=None, help=f"Accepted, without effect: {what}.",
                       **kind)
    g.add_argument("--normalization", default=None, choices=["RMSNorm", "LayerNorm"],
                   help="Megatron-LM's normalization flag: vime's models use RMSNorm; LayerNorm is refused "
                        "(default: None = RMSNorm).")
    g.add_argument("--position-embedding-type", default=None, choices=["rope", "learned_absolute", "none"],
                   help="Megatron-LM's position embedding flag: only rope is supported (default: None = rope).")


def flag_name(dest: str) -> str:
    """The flag a launch script spells for `dest`: Megatron-LM's name of a generated flag (`--apply-layernorm-1p`),
    else `--<dest with dashes>`."""
    return next((option["flags"][0] for option in megatron_option_table() if option["field"] == dest),
                "--" + dest.replace("_", "-"))


def core_flag(args: argparse.Namespace, name: str):
    """The value of megatron-core's generated flag `name` on `args` (None when not given). Those flags pass through
    untyped (`RunConfig.megatron_core`): this module, which generates them from megatron-core's dataclasses, is
    where they are read by name."""
    if name not in generated_dests():
        raise KeyError(f"{name} is not one of megatron-core's generated flags")
    return getattr(args, name)


def given_fields(args: argparse.Namespace, config_key: str) -> dict:
    """The generated flags a launch script set (not None) that belong to one config class ("transformer",
    "optimizer", "ddp"): applied over vime's own values where that config is built. A field that needs a GPU
    build (TransformerEngine, CUDA graphs, FP8) is dropped on CPU with a warning naming its flag, once."""
    from vime.utils.device import use_gpu

    given = {}
    for option in megatron_option_table():
        name = option["field"]
        value = getattr(args, name)
        if config_key not in option["owners"] or value is None:
            continue
        if value and name.startswith(GPU_ONLY_PREFIXES) and not use_gpu():
            warn_once(f"{option['flags'][0]} has no effect on CPU (it needs a GPU build of megatron-core's "
                       "dependencies): ignored")
            continue
        given[name] = value
    return given


GPU_ONLY_PREFIXES = ("fp8", "fp4", "tp_comm", "cuda_graph", "enable_cuda_graph", "external_cuda_graph",
                     "use_te_", "moe_enable_deepep", "moe_flex_dispatcher", "nccl_ub", "fsdp_double_buffer",
                     "cpu_offloading", "use_kitchen",
                     # what slime's MoE scripts set: TransformerEngine's fused kernels and optimizer, and moving
                     # optimizer state off a GPU the CPU run does not have
                     "moe_permute_fusion", "moe_router_fusion", "use_precision_aware_optimizer",
                     "optimizer_cpu_offload", "overlap_cpu_optimizer")


@functools.cache
def warn_once(message: str) -> None:
    """Log a warning once per process."""
    logger.warning(message)


def check_megatron_lm_architecture(args: argparse.Namespace) -> None:
    """The architecture flags Megatron-LM scripts carry that describe what vime builds anyway: equal is fine, a
    different value is an error naming both. Flags accepted without effect are named in a warning."""
    for flag, (_, what) in ACCEPTED_WITHOUT_EFFECT.items():
        if getattr(args, _accepted_dest(flag)) is not None:
            warn_once(f"{flag} has no effect: {what}")
    wrong = []
    if args.gated_linear_unit is False:
        wrong.append("a non-gated MLP (no --swiglu), but vime's models are SwiGLU models")
    if args.add_bias_linear is True:
        wrong.append("biases on the linear layers, but vime's models have none (pass --disable-bias-linear)")
    if args.normalization not in (None, "RMSNorm"):
        wrong.append(f"--normalization {args.normalization}, but vime's models use RMSNorm")
    if args.position_embedding_type not in (None, "rope"):
        wrong.append(f"--position-embedding-type {args.position_embedding_type}, but vime's models use rope")
    if wrong:
        raise ValueError("the launch script asks for " + "; ".join(wrong) + ": drop those flags or fix their values")
