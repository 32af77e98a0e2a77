"""vime's training-loop flags (how a rollout becomes optimizer steps), beside Megatron's own."""

from __future__ import annotations

import argparse
from pathlib import Path

from vime.config.algorithm import AlgorithmConfig
from vime.config.rollout import EnginesConfig, PromptDataConfig, RolloutConfig
from vime.config.run import DebugConfig, JobConfig
from vime.config.section import add_flags
from vime.config.train import LORA_TARGETS, LoraConfig, MegatronConfig, TrainLoopConfig, WeightSyncConfig
from vime.trainer.megatron.checkpoint_files import MARKER_FILE
from vime.utils.lora_adapters import adapter_specs
from vime.utils.misc import with_values


def add_train_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training loop")
    add_flags(g, TrainLoopConfig, part="batch")
    add_flags(g, WeightSyncConfig, TrainLoopConfig)  # TrainLoopConfig: its part-less fields
    add_flags(parser.add_argument_group(
        "trainer hooks", "slime's function paths called on every training rank, with slime's signatures."),
        TrainLoopConfig, part="hooks")
    g = parser.add_argument_group("LoRA")
    add_flags(g, LoraConfig)


def lora_targets(names) -> tuple[str, ...]:
    """--lora-target-modules as HF projection names in a fixed order; "all-linear" is every one."""
    names = list(names)
    if "all-linear" in names:
        return LORA_TARGETS
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown or not names:
        raise ValueError(f"--lora-target-modules {' '.join(names) or '(none)'}: "
                         f"{'unknown ' + ', '.join(unknown) if unknown else 'name at least one'}; choose from "
                         f"{', '.join(LORA_TARGETS)} or all-linear")
    return tuple(t for t in LORA_TARGETS if t in names)


def validate_lora_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check the LoRA flags; with --lora-load, returns `args` with the adapter's rank, alpha and targets."""
    adapter = LoraConfig.of(args).lora_load
    if adapter:
        args = with_values(args, **_peft_adapter_flags(adapter, args))
    lora = LoraConfig.of(args)
    lora.check()
    specs = adapter_specs(args)
    if not lora.lora_rank:
        for flag, given in (("--lora-sync", lora.lora_sync), ("--lora-adapters", specs)):
            if given:
                raise ValueError(f"{flag} needs --lora-rank N (LoRA training)")
        return args
    lora_targets(lora.lora_target_modules)
    if args.sequence_parallel:  # megatron-core's flag
        raise ValueError("--lora-rank with --sequence-parallel is not supported yet; drop one of them")
    sync = lora_sync_mode(args)
    if specs:
        _check_adapters(args, specs, sync)
    return with_values(args, lora_sync=sync)


def _check_adapters(args: argparse.Namespace, specs, sync: str) -> None:
    """--lora-adapters with the flags it needs and excludes."""
    lora = LoraConfig.of(args)
    prompt_data = PromptDataConfig.of(args)
    rollout = RolloutConfig.of(args)
    from pathlib import Path

    if sync != "adapter":
        raise ValueError("--lora-adapters needs --lora-sync adapter (engines that serve each adapter by name); merged "
                         "weights hold one adapter")
    if lora.lora_load:
        raise ValueError("--lora-adapters starts every adapter fresh; drop --lora-load")
    if prompt_data.prompt_data:
        raise ValueError("--lora-adapters names each adapter's prompts (NAME=PROMPT_DATA); drop --prompt-data")
    if rollout.rollout_batch_size % len(specs):
        raise ValueError(f"--rollout-batch-size {rollout.rollout_batch_size} must be a multiple of the "
                         f"{len(specs)} --lora-adapters: each rollout takes an equal share of prompts per adapter")
    for spec in specs:
        if not Path(spec.prompt_data).is_file():
            raise ValueError(f"--lora-adapters {spec.name}: prompt file {spec.prompt_data} not found")


MAX_SERVED_LORA_RANK = 512  # vLLM's largest --max-lora-rank


def lora_sync_mode(args: argparse.Namespace) -> str:
    """--lora-sync, resolved: adapter unless the engines are external (they may lack LoRA support and vime's
    update route), or the model is an MoE and this process sees no GPU (vLLM's CPU engine cannot serve adapters on
    an MoE; merged works on any engine, so it is the safe default where the engines' devices are not known yet:
    a CPU-only head node). Adapter sync refused where it cannot work; on CPU engines of an MoE once the cluster's
    devices are known (`lora_sync_on_devices`)."""
    engines = EnginesConfig.of(args)
    job = JobConfig.of(args)
    lora = LoraConfig.of(args)
    weight_sync = WeightSyncConfig.of(args)
    from vime.engine.control.engine import is_moe
    from vime.utils.device import use_gpu

    external = bool(engines.rollout_external_engine_addrs)
    mode = lora.lora_sync or ("merged" if external or (not use_gpu() and is_moe(job.hf_checkpoint)) else "adapter")
    if mode == "merged":
        return mode
    if external:
        raise ValueError("--lora-sync adapter needs engines vime starts (their update route loads each adapter); "
                         "external engines get --lora-sync merged")
    if weight_sync.update_weight_transport != "disk":
        raise ValueError(f"--update-weight-transport {weight_sync.update_weight_transport} sends full weights; a LoRA "
                         "run "
                         "sends only its adapters (--lora-sync adapter, the default): drop the transport flag, or "
                         "pass --lora-sync merged to send the merged weights through it")
    if lora.lora_rank > MAX_SERVED_LORA_RANK:
        raise ValueError(f"--lora-rank {lora.lora_rank}: vLLM serves adapters of rank <= {MAX_SERVED_LORA_RANK}; "
                         "use a smaller rank, or --lora-sync merged")
    return mode


def lora_sync_on_devices(args: argparse.Namespace, gpus: bool | None) -> None:
    """--lora-sync adapter on CPU engines (`gpus` False) of an MoE model: vLLM's CPU engine serves LoRA adapters on
    dense models only (its LoRA path for MoE layers needs Triton). None (devices unknown yet): nothing to refuse."""
    from vime.engine.control.engine import is_moe

    job, lora = JobConfig.of(args), LoraConfig.of(args)
    if gpus is False and lora.lora_rank and lora.lora_sync == "adapter" and is_moe(job.hf_checkpoint):
        raise ValueError(f"--lora-sync adapter: {job.hf_checkpoint} is a mixture-of-experts model, and vLLM's CPU "
                         "engine serves LoRA adapters on dense models only (its LoRA path for MoE layers needs "
                         "Triton); use --lora-sync merged, the default for MoE models on CPU")


def _peft_adapter_flags(path: str, args: argparse.Namespace) -> dict:
    """--lora-rank/--lora-alpha/--lora-target-modules read from a PEFT adapter's adapter_config.json; a flag given
    with another value is refused."""
    import json
    from pathlib import Path

    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file() or not (Path(path) / "adapter_model.safetensors").is_file():
        raise ValueError(f"--lora-load {path}: not a PEFT adapter (needs adapter_config.json and "
                         "adapter_model.safetensors)")
    config = json.loads(config_file.read_text())
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise ValueError(f"--lora-load {path}: a plain LoRA adapter is needed (peft_type LORA, no DoRA, no rsLoRA)")
    found = {"lora_rank": int(config["r"]), "lora_alpha": float(config.get("lora_alpha", config["r"])),
             "lora_target_modules": ["all-linear"] if targets == ["all-linear"] else targets}
    lora = LoraConfig.of(args)
    for flag, value in found.items():
        given = getattr(lora, flag)
        if flag != "lora_target_modules" and given not in (None, 0, value):
            raise ValueError(f"--{flag.replace('_', '-')} {given} contradicts the --lora-load adapter's {value}; "
                             "drop the flag")
    return found


def lr_schedule_problem(args: argparse.Namespace, total_steps: int) -> str | None:
    """What Megatron's `OptimizerParamScheduler` would assert about the run's schedule (its checks, which fire only
    once the trainers build their optimizers, after Ray, the engines and the router started), or None. vime builds
    it with init_lr 0 under warmup (else --lr), max_lr --lr (or --critic-lr), min_lr --min-lr, warmup
    --lr-warmup-iters and decay over the run's `total_steps` optimizer steps (--num-rollout x
    --num-steps-per-rollout). tests/unit/test_arguments.py holds this against Megatron's own constructor."""
    megatron = MegatronConfig.of(args)
    train_loop = TrainLoopConfig.of(args)
    algorithm = AlgorithmConfig.of(args)
    rates = [("--lr", megatron.lr)]
    if train_loop.critic_lr is not None and algorithm.use_critic:
        rates.append(("--critic-lr", train_loop.critic_lr))
    if megatron.min_lr < 0:
        return f"--min-lr {megatron.min_lr} is negative; use 0 or more"
    for flag, lr in rates:
        if lr < megatron.min_lr:
            return f"{flag} {lr} is below --min-lr {megatron.min_lr}; lower --min-lr"
        if megatron.lr_warmup_iters and lr < 0:
            return f"{flag} {lr} is negative: warmup would start above it; use a positive rate"
    decay_steps = max(total_steps, 1)
    if megatron.lr_warmup_iters >= decay_steps:
        return (f"--lr-warmup-iters {megatron.lr_warmup_iters} is not below the run's {decay_steps} optimizer step(s) "
                f"(--num-rollout x --num-steps-per-rollout, {train_loop.num_steps_per_rollout} a rollout): lower "
                "--lr-warmup-iters, or train longer (--num-rollout, or fewer samples per step with "
                "--global-batch-size)")
    if megatron.weight_decay < 0:
        return f"--weight-decay {megatron.weight_decay} is negative; use 0 or more"
    return None


def validate_train_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check the training-loop flags; returns a copy of `args` with --global-batch-size and
    --num-steps-per-rollout derived from each other and the rollout's size."""
    rollout, train_loop, megatron = RolloutConfig.of(args), TrainLoopConfig.of(args), MegatronConfig.of(args)
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    steps = train_loop.num_steps_per_rollout
    if steps is not None:
        if samples % steps:
            raise ValueError(f"--num-steps-per-rollout {steps} does not divide the "
                             f"{samples} samples of a rollout (rollout-batch-size x n-samples-per-prompt)")
        gbs = samples // steps
        if megatron.global_batch_size is not None and megatron.global_batch_size != gbs:
            raise ValueError(f"--global-batch-size {megatron.global_batch_size} contradicts --num-steps-per-rollout "
                             f"{steps} ({samples} samples per rollout -> {gbs}); give one")
    else:
        gbs = samples if megatron.global_batch_size is None else megatron.global_batch_size
    if samples % gbs:
        raise ValueError(f"--global-batch-size {gbs} must divide the {samples} samples of a "
                         "rollout (rollout-batch-size x n-samples-per-prompt)")
    WeightSyncConfig.of(args).check()
    if AlgorithmConfig.of(args).use_critic and megatron.pipeline_model_parallel_size > 1:
        raise ValueError("the PPO critic (--advantage-estimator ppo) supports --pipeline-model-parallel-size 1 "
                         "only; use tensor or data parallelism")
    train_loop.check()
    _check_ref_load(megatron, LoraConfig.of(args))
    args = with_values(validate_lora_args(args), global_batch_size=gbs, num_steps_per_rollout=samples // gbs)
    job = JobConfig.of(args)
    if job.num_rollout is not None and not DebugConfig.of(args).debug_rollout_only:  # else known once counted
        problem = lr_schedule_problem(args, job.num_rollout * (samples // gbs))
        if problem:
            raise ValueError(problem)
    return args


def _check_ref_load(megatron: MegatronConfig, lora: LoraConfig) -> None:
    """--ref-load names a checkpoint directory (torch_dist or HF), and is not a second base under LoRA."""
    if not megatron.ref_load:
        return
    path = Path(megatron.ref_load)
    if not path.is_dir():
        raise ValueError(f"--ref-load {megatron.ref_load} does not exist: give a torch_dist checkpoint directory "
                         "(scripts/convert_hf_to_torch_dist.py writes one) or an HF directory")
    if not (path / "config.json").is_file() and not (path / MARKER_FILE).is_file() and not any(path.glob("iter_*")):
        raise ValueError(f"--ref-load {megatron.ref_load} is neither a torch_dist checkpoint ({MARKER_FILE}, "
                         "iter_*/ or release/) nor an HF directory (config.json)")
    if lora.lora_rank:
        raise ValueError("--ref-load with --lora-rank: LoRA trains adapters on a frozen base, which is the KL "
                         "reference already; load the base with --hf-checkpoint and drop --ref-load")
