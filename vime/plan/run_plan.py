"""A run's memory plan from its train.py flags: the shape from --hf-checkpoint's config.json, the layout from the
Megatron, rollout and placement flags, then `memory.trainer_memory` / `memory.engine_memory` per role and the
step's counted FLOPs (`trainer.flops`), as `python -m vime.plan` prints it and `train.py` checks it on GPUs.

A step's micro-batches are planned at their largest: --micro-batch-size samples of --rollout-max-prompt-len plus
--rollout-max-response-len tokens (--max-tokens-per-gpu with --use-dynamic-batch-size), each group's prompt once
where micro-batches share prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vime.config.algorithm import AlgorithmConfig, DistillationConfig
from vime.config.rollout import EnginesConfig, PromptDataConfig, RolloutConfig
from vime.config.run import JobConfig, PlacementConfig
from vime.config.train import LoraConfig, MegatronConfig, TrainLoopConfig
from vime.plan.memory import GIB, EngineLayout, TrainerLayout, engine_memory, trainer_memory
from vime.trainer.flops import FlopShape, rollout_flops
from vime.trainer.megatron.megatron_flags import core_flag

DEFAULT_PROMPT_LEN = 1024  # where --rollout-max-prompt-len is not given


@dataclass(frozen=True)
class Plan:
    roles: dict[str, dict]  # role -> {"parts_gib": {...}, "peak_gib", "fits", ...}
    flops_per_step: float
    tokens_per_step: int
    gpu_memory_gib: float
    layout: dict

    def as_json(self) -> dict:
        return {"gpu_memory_gib": self.gpu_memory_gib, "layout": self.layout, "roles": self.roles,
                "flops_per_step": self.flops_per_step, "tokens_per_step": self.tokens_per_step}

    def unfit(self) -> list[str]:
        return [role for role, r in self.roles.items() if not r["fits"]]


def _hf_config(args):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(JobConfig.of(args).hf_checkpoint)


def _recompute(args) -> str:
    granularity = core_flag(args, "recompute_granularity")
    return granularity if granularity in ("full", "selective") else "none"


def _dtype_bytes(megatron: MegatronConfig, device: str) -> int:
    return 2 if device == "cuda" and (megatron.bf16 or megatron.fp16) else 4


def shares_prompts(args, shape: FlopShape) -> bool:
    """Whether micro-batches hold each group's prompt once (`trainer.passes.prompt_sharing`'s rule, for vime's
    local spec: packed, dense, standard attention with no linear-attention layers, no per-sample adapters or routing
    replay)."""
    from vime.config.train import RoutingReplayConfig

    return (TrainLoopConfig.of(args).share_group_prompts and MegatronConfig.of(args).qkv_format == "thd"
            and not LoraConfig.of(args).lora_adapters and not RoutingReplayConfig.of(args).use_rollout_routing_replay
            and not shape.kv_lora_rank and not shape.moe_layers and not shape.linear_layers)


def micro_batch_lengths(args) -> tuple[int, int, int]:
    """(prompt tokens, response tokens, samples) of the step's largest micro-batch."""
    megatron, rollout, loop = MegatronConfig.of(args), RolloutConfig.of(args), TrainLoopConfig.of(args)
    prompt = PromptDataConfig.of(args).rollout_max_prompt_len or DEFAULT_PROMPT_LEN
    response = rollout.rollout_max_response_len
    if loop.use_dynamic_batch_size and loop.max_tokens_per_gpu:
        return prompt, response, max(1, loop.max_tokens_per_gpu // (prompt + response))
    return prompt, response, megatron.micro_batch_size


def micro_batch_shape(args, shape: FlopShape) -> tuple[int, int, int]:
    """(rows the layers compute, rows that need logits, samples) of the step's largest micro-batch."""
    prompt, response, samples = micro_batch_lengths(args)
    share = shares_prompts(args, shape)
    groups = math.ceil(samples / RolloutConfig.of(args).n_samples_per_prompt) if share else samples
    return groups * prompt + samples * response, samples * response, samples


def trainer_layout(args, shape: FlopShape, device: str = "cuda", critic: bool = False) -> TrainerLayout:
    megatron, rollout, placement = MegatronConfig.of(args), RolloutConfig.of(args), PlacementConfig.of(args)
    world = placement.actor_num_nodes * placement.actor_num_gpus_per_node
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    dp = max(world // (tp * pp), 1)
    rows, logit_rows, samples = micro_batch_shape(args, shape)
    step_samples = (megatron.global_batch_size or rollout.rollout_batch_size * rollout.n_samples_per_prompt)
    algorithm, distillation = AlgorithmConfig.of(args), DistillationConfig.of(args)
    snapshots = 0 if critic else int(bool(algorithm.use_kl_loss or algorithm.kl_coef)) + \
        int(distillation.opd_teacher_checkpoint is not None)
    return TrainerLayout(tp=tp, pp=pp, dp=dp, ep=megatron.expert_model_parallel_size,
                         etp=megatron.expert_tensor_parallel_size or tp,
                         sequence_parallel=bool(core_flag(args, "sequence_parallel")),
                         distributed_optimizer=megatron.use_distributed_optimizer,
                         weight_bytes=_dtype_bytes(megatron, device), micro_batch_tokens=rows,
                         logit_rows=logit_rows, micro_batches=max(step_samples // max(dp * samples, 1), 1),
                         recompute=_recompute(args), snapshots=snapshots, value_head=critic, device=device)


def engine_layout(args, device: str = "cuda") -> EngineLayout:
    from vime.engine.control.engine import engine_memory_fraction

    megatron, rollout = MegatronConfig.of(args), RolloutConfig.of(args)
    prompt = PromptDataConfig.of(args).rollout_max_prompt_len or DEFAULT_PROMPT_LEN
    utilization = args.vllm_gpu_memory_utilization or engine_memory_fraction(args) or 0.92
    weight = _dtype_bytes(megatron, device) if not args.vllm_dtype else (4 if args.vllm_dtype == "float32" else 2)
    kv = 1 if (args.vllm_kv_cache_dtype or "auto").startswith("fp8") else weight
    return EngineLayout(tp=EnginesConfig.of(args).rollout_num_gpus_per_engine or 1, weight_bytes=weight, kv_bytes=kv,
                        memory_utilization=float(utilization),
                        max_model_len=args.vllm_max_model_len or prompt + rollout.rollout_max_response_len)


def step_flops(shape: FlopShape, args, device: str = "cuda") -> tuple[float, int]:
    """The counted FLOPs and tokens of one rollout's training, all ranks together: every micro-batch at the
    planned size, built as the trainer builds them (`batching.micro_batch_inputs`), with the forward-only passes
    the flags ask for."""
    from vime.trainer.batching import micro_batch_inputs
    from vime.trainer.flops import micro_batch_work

    megatron, rollout, loop = MegatronConfig.of(args), RolloutConfig.of(args), TrainLoopConfig.of(args)
    algorithm, distillation = AlgorithmConfig.of(args), DistillationConfig.of(args)
    prompt, response, samples = micro_batch_lengths(args)
    share, packed = shares_prompts(args, shape), megatron.qkv_format == "thd"
    group = rollout.n_samples_per_prompt
    tokens = [[2 + i // group] * prompt + [1] * response for i in range(samples)]  # samples of a group share
    inputs = micro_batch_inputs(tokens, [response] * samples, packed=packed, share_prompts=share)
    varlen = device == "cuda" and packed and not share and _dtype_bytes(megatron, device) == 2
    work = micro_batch_work(inputs, [prompt + response] * samples, varlen)
    total_samples = rollout.rollout_batch_size * group
    steps = loop.num_steps_per_rollout or max(total_samples // (megatron.global_batch_size or total_samples), 1)
    micro = max(total_samples // (samples * steps), 1)
    forward = int(steps > 1) + int(bool(algorithm.use_kl_loss or algorithm.kl_coef)) + \
        int(distillation.opd_teacher_checkpoint is not None)
    flops = rollout_flops(shape, [[work] * micro for _ in range(steps)], forward)["useful"]
    return flops, work.rows * micro * steps


def _gib(parts: dict[str, float]) -> dict[str, float]:
    return {k: round(v / GIB, 3) for k, v in parts.items()}


def plan_run(args, gpu_memory_gib: float, device: str = "cuda", hf_config=None) -> Plan:
    """The run's plan on devices of `gpu_memory_gib` each."""
    config = hf_config or _hf_config(args)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    shape = FlopShape.from_hf(config, LoraConfig.of(args).lora_rank)
    gpu = gpu_memory_gib * GIB
    placement = PlacementConfig.of(args)
    roles = {}
    trainers = [("trainer", False)] + ([("critic", True)] if AlgorithmConfig.of(args).use_critic else [])
    engine = engine_memory(shape, engine_layout(args, device), gpu, tied)
    for role, critic in trainers:
        memory = trainer_memory(shape, trainer_layout(args, shape, device, critic), tied)
        peak = memory.peak_bytes
        beside = 0.0
        if placement.colocate and not placement.offload_rollout:  # the engine stays resident while training
            beside = engine["peak"]
        roles[role] = {"parts_gib": _gib({**memory.parts, "runtime": memory.overhead}),
                       "peak_gib": round(peak / GIB, 3), "beside_gib": round(beside / GIB, 3),
                       "fits": peak + beside <= gpu}
    roles["engine"] = {"parts_gib": _gib({k: engine[k] for k in ("weights", "runtime", "kv_cache")}),
                       "peak_gib": round(engine["peak"] / GIB, 3), "kv_cache_tokens": engine["kv_cache_tokens"],
                       "fits": engine["fits"]}
    flops, tokens = step_flops(shape, args, device)
    layout = trainer_layout(args, shape, device)
    return Plan(roles, flops, tokens, gpu_memory_gib,
                {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep, "etp": layout.etp,
                 "micro_batch_tokens": layout.micro_batch_tokens, "recompute": layout.recompute,
                 "distributed_optimizer": layout.distributed_optimizer, "dtype_bytes": layout.weight_bytes})


def how_to_fit(plan: Plan) -> str:
    """The flags that shrink what does not fit, largest part first."""
    hints = []
    for role in plan.unfit():
        parts = plan.roles[role]["parts_gib"]
        if role == "engine":
            hints.append("engine: raise --vllm-gpu-memory-utilization, lower --vllm-max-model-len, or more GPUs per "
                         "engine (--rollout-num-gpus-per-engine)")
            continue
        largest = max(parts, key=parts.get)
        hint = {"activations": "--recompute-granularity full --recompute-method uniform, a smaller "
                               "--micro-batch-size (or --max-tokens-per-gpu), or --sequence-parallel with TP",
                "logits": "a smaller --micro-batch-size or larger --tensor-model-parallel-size (the vocabulary "
                          "splits over TP)",
                "optimizer": "--use-distributed-optimizer (shards Adam over data-parallel ranks), or more TP/PP",
                "weights": "larger --tensor-model-parallel-size / --pipeline-model-parallel-size "
                           "(--expert-model-parallel-size for MoE)",
                "gradients": "larger --tensor-model-parallel-size / --pipeline-model-parallel-size, or LoRA",
                "snapshots": "--ref-load on fewer ranks is not possible: more TP/PP, or LoRA (adapters only)"}
        hints.append(f"{role} ({plan.roles[role]['peak_gib']:.1f} GiB of {plan.gpu_memory_gib:g}; largest: "
                     f"{largest} {parts[largest]:.1f} GiB): {hint.get(largest, 'more GPUs')}")
    return "; ".join(hints)


def check_memory_plan(args, gpu_memory_gib: float | None) -> Plan | None:
    """A GPU run's check before it starts: the plan on devices of `gpu_memory_gib` (None: unknown, logged and
    skipped), refused with `ArgumentsError` naming the flags that would make it fit."""
    import logging

    from vime.arguments import ArgumentsError

    logger = logging.getLogger(__name__)
    if gpu_memory_gib is None:
        logger.warning("memory plan skipped: the cluster's GPU model is not one vime knows; give --gpu-memory-gib")
        return None
    plan = plan_run(args, gpu_memory_gib)
    logger.info("memory plan (GiB of %g): %s", gpu_memory_gib,
                ", ".join(f"{role} {r['peak_gib']:.1f}" for role, r in plan.roles.items()))
    if plan.unfit():
        raise ArgumentsError(f"this layout does not fit devices of {gpu_memory_gib:g} GiB (python -m vime.plan "
                             f"prints the plan): {how_to_fit(plan)}")
    return plan
