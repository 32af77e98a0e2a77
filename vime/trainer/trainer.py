"""One Megatron training rank: turns a rollout into optimizer steps.

    trainer = MegatronTrainer(args, rank, world_size, master_addr, master_port)   # one per process
    metrics = trainer.train(rollout_id, groups)                                    # groups of Sample dicts

Every rank reads the whole rollout from the data transport (its Ray actor, `vime.driver.train_group`, does; the
rollout is small next to the model), turns it into a `TrainBatch` and derives the same step / data-parallel /
micro-batch split from it, so no scatter is needed. Per rollout: (optional) reference and old log-probs ->
advantages -> --num-steps-per-rollout optimizer steps. A step whose loss or gradients are NaN or inf on any rank is
skipped (train/skipped_steps, train/skipped/<reason>); a step that leaves a parameter non-finite stops the run.

The parts of a rollout live beside it: `passes` (Megatron's schedule: forward-only, a training step), `weight_snapshots`
(the reference and teacher swapped in), `advantages`, `loss` and `critic`, `step_metrics`, `non_finite`.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from vime.algorithms import masked_mean_std
from vime.algorithms.shaping import entropy_coef_at, mask_truncated
from vime.config.algorithm import AlgorithmConfig, DistillationConfig, RolloutCorrectionConfig
from vime.config.run import JobConfig
from vime.config.train import LoraConfig, MegatronConfig, TrainLoopConfig
from vime.trainer.batch_advantages import PER_TOKEN_ESTIMATORS, add_opd_rewards, compute_advantages
from vime.trainer.batching import SplitRule, rank_share, split_rollout
from vime.trainer.critic import attach_value_head, make_value_loss_fn
from vime.trainer.hooks import TrainerHooks, apply_rollout_data, rollout_data_view
from vime.trainer.megatron.checkpoint import load_checkpoint, save_checkpoint
from vime.trainer.megatron.device import model_device
from vime.trainer.megatron.lora import LoraSetup, adapters_merged, attach_lora, load_peft_adapter
from vime.trainer.megatron.model import setup_model_and_optimizer
from vime.trainer.micro_batch_loss import make_loss_fn, step_denominators
from vime.trainer.moe_metrics import ExpertLoad, take_moe_losses
from vime.trainer.non_finite import FiniteStepGuard, check_finite_parameters
from vime.trainer.offload import TrainStateOffloader
from vime.trainer.old_actor import OldActor, old_log_probs_by_version, sample_versions
from vime.trainer.passes import OnHost, forward_log_probs, forward_values, is_packed, prompt_sharing, train_step
from vime.trainer.reference import reference_state, refresh_due
from vime.trainer.routing_replay import rollout_routing
from vime.trainer.step_metrics import read_metrics, reduce_step_metrics, reports_metrics
from vime.trainer.train_batch import TrainBatch
from vime.trainer.train_records import saves_train_records, write_train_records
from vime.trainer.weight_snapshots import dense, log_probs_under, snapshot, teacher_snapshot
from vime.utils.plugin_args import plugin_view_from

logger = logging.getLogger(__name__)
STORE_PREFIX = {"reference": "ref_", "teacher": "teacher_"}  # slime's names of the log-prob passes


class MegatronTrainer:
    def __init__(self, args, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, total_steps: int = 1000, role: str = "actor", local_rank: int = 0):
        from transformers import AutoConfig

        from vime.trainer.megatron.arguments import fill_architecture_from_hf, validate_megatron_args
        from vime.trainer.megatron.hf_checkpoint import load_hf_checkpoint_into_model
        from vime.trainer.megatron.parallel import init_parallel

        if world_size > 1 or master_port is not None:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                              MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        megatron, job = MegatronConfig.of(args), JobConfig.of(args)
        init_parallel(megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size, seed=job.seed,
                      expert_model_parallel_size=megatron.expert_model_parallel_size,
                      expert_tensor_parallel_size=megatron.expert_tensor_parallel_size)
        self.hf_config = AutoConfig.from_pretrained(job.hf_checkpoint)
        # the run's flags plus the architecture read from the checkpoint: this rank's own copy
        args = validate_megatron_args(fill_architecture_from_hf(args, self.hf_config), world_size=dist.get_world_size())
        megatron, lora_flags = MegatronConfig.of(args), LoraConfig.of(args)
        self.args = args
        self.plugin_args = plugin_view_from(args, None)  # what custom functions get (`set_plugin_values`)
        self.role = role
        self.hooks = TrainerHooks.of(TrainLoopConfig.of(args))  # slime's trainer hooks
        if self.hooks.init is not None:
            self.hooks.init(self.plugin_args)

        lora = LoraSetup.from_args(args) if role == "actor" else None  # the critic trains in full

        def prepare(chunks):
            load_hf_checkpoint_into_model(chunks, job.hf_checkpoint)
            if role == "critic":
                attach_value_head(chunks)
            elif lora is not None:  # a frozen base: only the adapters get grads and state
                for chunk in chunks:
                    attach_lora(chunk, lora)
                    if lora_flags.lora_load:
                        load_peft_adapter(chunk, lora_flags.lora_load)

        self.model, self.optimizer, self.scheduler = setup_model_and_optimizer(args, total_steps, prepare)
        self.device = model_device(self.model)  # where build_model_chunks put it (training_device)
        no_sharing = prompt_sharing(args, self.model)
        logger.info("training %s: micro-batches %s", role, "share each group's prompt" if no_sharing is None
                    else f"hold a copy of the prompt per sample (prompt sharing off: {no_sharing})")
        self.lora = lora
        self.expert_load = ExpertLoad(self.model, megatron.num_layers, megatron.num_experts) if megatron.num_experts \
            else None
        self.step = 0
        self.offloader = TrainStateOffloader()  # --offload-train
        self.loaded_state = self.last_returns = None
        self.forward_passes = 0  # forward-only passes over the last rollout (old log-probs, reference, teacher)
        # The KL reference: --ref-load, else the starting point (the HF checkpoint or a converted `release`; with
        # LoRA the starting adapters alone). An empty --load starts the actor from --ref-load (slime's rule).
        self.ref_state = reference_state(self.model, self.optimizer, megatron, self._needs_ref(),
                                         lora is not None) if role == "actor" else None
        teacher = DistillationConfig.of(args).opd_teacher_checkpoint
        self.teacher_state = teacher_snapshot(self.model, teacher) if self._needs_teacher() else None
        if megatron.load:
            self.loaded_state = load_checkpoint(self, megatron.load)
        self.old_actor = OldActor.for_run(TrainLoopConfig.of(args), lora is not None) if role == "actor" else None
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.saves_train_records = saves_train_records(args, role)  # its share of each rollout, for the inspector

    def _step_metrics(self, mb_metrics: list[dict], num_micro_batches: int) -> dict:
        """The step's metrics reduced over micro-batches and data-parallel ranks, and the MoE routers'. Collective."""
        return {**reduce_step_metrics(mb_metrics, self.dp_size, self.device), **self._moe_metrics(num_micro_batches)}

    def _moe_metrics(self, num_micro_batches: int) -> dict:
        """The routers' losses and expert loads of the step just run ({} for dense models). Collective."""
        if self.expert_load is None:
            return {}
        return {**take_moe_losses(self.args, num_micro_batches, self.device), **self.expert_load.take()}

    # ---- reference weights (KL) -----------------------------------------------------------------------------
    def _needs_ref(self) -> bool:
        algorithm = AlgorithmConfig.of(self.args)
        return self.role == "actor" and bool(algorithm.use_kl_loss or algorithm.kl_coef)

    def _needs_teacher(self) -> bool:
        return self.role == "actor" and DistillationConfig.of(self.args).opd_teacher_checkpoint is not None

    # ---- data ------------------------------------------------------------------------------------------------
    def _split(self, batch: TrainBatch, every_sample: bool = False) -> list[tuple[range, list[int], list]]:
        """Per optimizer step: (the step's sample positions, this rank's share, its micro-batches); see
        `batching.split_rollout`."""
        return split_rollout(self._split_rule(), batch.loss_masks, [len(t) for t in batch.tokens], self.dp_rank,
                             every_sample)

    def _split_rule(self) -> SplitRule:
        train_loop, megatron = TrainLoopConfig.of(self.args), MegatronConfig.of(self.args)
        return SplitRule(self.dp_size, megatron.global_batch_size, megatron.micro_batch_size,
                         train_loop.max_tokens_per_gpu if train_loop.use_dynamic_batch_size else None,
                         is_packed(self.args))

    def _step_micro_batches(self, batch: TrainBatch, step) -> int:
        """The micro-batches of `step` over all data-parallel ranks (--loss-agg-mode bnpo averages over them)."""
        lengths = [len(t) for t in batch.tokens]
        return sum(len(rank_share(self._split_rule(), batch.loss_masks, step, lengths, r)[1])
                   for r in range(self.dp_size))

    # ---- one rollout -----------------------------------------------------------------------------------------
    def train(self, rollout_id: int, groups: list[list[dict]], values: dict | None = None) -> dict[str, float]:
        """Actor: one rollout's optimizer steps. `values` ({sample index: per-token values}) come from the
        critic for --advantage-estimator ppo; the GAE returns are then kept in `last_returns` for it."""
        args, algorithm = self.args, AlgorithmConfig.of(self.args)
        train_loop, distillation = TrainLoopConfig.of(args), DistillationConfig.of(args)
        # the trainer has trained `rollout_id` rollouts: its weights are the version an update would label so
        batch = TrainBatch.from_samples(groups, self.args, trainer_version=rollout_id)
        if values is not None:
            batch.values = [torch.as_tensor(values[i], dtype=torch.float32) for i in range(len(batch.tokens))]
        metrics: dict[str, float] = {}
        sft = algorithm.loss_type == "sft_loss"
        if algorithm.mask_truncated_samples and not sft:  # before the split: they are not computed
            batch.loss_masks, masked = mask_truncated(batch.loss_masks, batch.truncated)
            metrics["train/truncated_masked_fraction"] = masked / max(1, batch.num_usable)
        # this rollout's entropy bonus: a value of the step, handed to the loss (the flags stay as parsed)
        entropy_coef = entropy_coef_at(rollout_id, algorithm.entropy_coef, algorithm.entropy_coef_final,
                                       algorithm.entropy_coef_decay_rollouts, algorithm.entropy_coef_schedule)
        if algorithm.entropy_coef_schedule != "constant":
            metrics["train/entropy_coef"] = float(entropy_coef)
        plan = self._split(batch)
        all_local_mbs = [mb for _, _, mbs in plan for mb in mbs]
        # --use-rollout-logprobs: the engine's log-probs are the old policy; no forward pass for it
        bypass = RolloutCorrectionConfig.of(args).use_rollout_logprobs and all(
            r is not None for r in batch.rollout_log_probs)
        versions, older = sample_versions(groups), {}
        if self.old_actor is not None and not sft:  # --keep-old-actor: the weights each sample was generated with
            self.old_actor.keep(self.model, rollout_id)
            older = self.old_actor.states_for(versions, rollout_id)
        needs_old = not sft and (
            bool(older) or (len(plan) > 1 and not bypass)
            or (algorithm.kl_coef and algorithm.advantage_estimator in PER_TOKEN_ESTIMATORS)
            or (self.teacher_state is not None and any(lp is None for lp in batch.rollout_log_probs)))
        routing = rollout_routing(args, self.model, batch, first_pass=needs_old)
        phase = routing.phase if routing is not None else (lambda name: contextlib.nullcontext())
        states = {k: v for k, v in (("reference", self.ref_state), ("teacher", self.teacher_state)) if v is not None
                  and not sft}
        self.forward_passes = int(needs_old) + len(states) + len(older)  # what `flops.trainer_rollout_flops` counts
        swapped = log_probs_under(args, self.model, states, batch, all_local_mbs, routing, phase,
                                  adapters_only=self.lora is not None and all(v is self.ref_state
                                                                              for v in states.values()),
                                  before=lambda name: self.hooks.log_prob_pass(self.plugin_args, self.model,
                                                                               STORE_PREFIX[name]))
        batch.ref_log_probs, batch.teacher_log_probs = swapped.get("reference"), swapped.get("teacher")
        if needs_old:  # --use-routing-replay records this first pass's routing for the optimizer steps
            self.hooks.log_prob_pass(self.plugin_args, self.model, "")
            with phase("first_pass"):
                old = forward_log_probs(args, self.model, batch, all_local_mbs, routing=routing)
            batch.old_log_probs = dense(old, len(batch.tokens))
        if older:
            metrics["train/old_actor_samples"] = float(old_log_probs_by_version(
                args, self.model, older, versions, batch, all_local_mbs, routing, phase, self.lora is not None,
                before=lambda _: self.hooks.log_prob_pass(self.plugin_args, self.model, "")))
        if not sft:
            metrics.update(compute_advantages(args, batch))
            self.last_returns = [r.tolist() for r in batch.returns] if batch.values is not None else None
            # the estimator's own output, over the whole batch's trainable tokens (every rank holds all of it)
            metrics["train/advantage_mean"], metrics["train/advantage_std"] = masked_mean_std(batch.advantages,
                                                                                              batch.loss_masks)
            if batch.values is not None:
                metrics["train/return_mean"] = masked_mean_std(batch.returns, batch.loss_masks)[0]
            if self.teacher_state is not None and distillation.opd_mode == "reward":
                add_opd_rewards(batch, distillation.opd_coef)
        if self.hooks.postprocess is not None:  # slime's: e.g. change the loss masks before training
            rollout_data = rollout_data_view(batch)
            self.hooks.postprocess(self.plugin_args, rollout_id, rollout_data)
            apply_rollout_data(batch, rollout_data, train_loop.rollout_data_postprocess_path)

        # the inspector's trainer log-probs: those of the first step's forward, under the rollout's weights, unless
        # the old log-probs were computed for all of them already
        first_step_log_probs = OnHost() if self.saves_train_records and batch.old_log_probs is None else None
        for step_index, (step, local, mbs) in enumerate(plan):
            denominators = step_denominators(batch, step)
            if algorithm.loss_agg_mode == "bnpo":
                denominators["micro_batches"] = self._step_micro_batches(batch, step)
            loss_fn = make_loss_fn(args, batch, denominators, scale=len(mbs) * self.dp_size,
                                   step_index=step_index, plugin_args=self.plugin_args, entropy_coef=entropy_coef,
                                   keep_log_probs=first_step_log_probs if step_index == 0 else None)
            if self.hooks.before_train_step is not None:
                self.hooks.before_train_step(self.plugin_args, rollout_id, step_index, self.model, self.optimizer,
                                             self.scheduler)
            with phase("steps"):
                mb_metrics, grad_norm, lr, skipped = self._train_step(batch, mbs, loss_fn, metrics, routing=routing)
            self.step += 1
            step_metrics = self._step_metrics(mb_metrics, len(mbs))
            if "logprob_diff_count" in step_metrics:  # first step only: the rollout policy's parameters
                count = step_metrics.pop("logprob_diff_count").clamp(min=1.0)
                metrics["train_rollout_logprob_abs_diff"] = step_metrics.pop("logprob_diff_sum") / count
                metrics["train_rollout_logprob_abs_diff_max"] = step_metrics.pop("logprob_diff_max")
            for k, v in step_metrics.items():
                metrics[f"train/{k}"] = metrics.get(f"train/{k}", 0.0) + v / len(plan)
            metrics["train/grad_norm"] = float(grad_norm or 0.0)
            metrics["train/lr"] = float(lr)
            metrics["train/skipped_steps"] = metrics.get("train/skipped_steps", 0.0) + float(skipped)
        metrics["train/num_usable_samples"] = float(batch.num_usable)
        if train_loop.max_staleness is not None:
            metrics["async/stale_samples_dropped"] = float(batch.stale)
        metrics["train/steps"] = float(len(plan))
        if self.ref_state is not None and refresh_due(rollout_id, algorithm.ref_update_interval):
            self.ref_state = snapshot(self.model, adapters_only=self.lora is not None)  # --ref-update-interval
            metrics["train/ref_updated"] = 1.0
        if self.saves_train_records:  # for the inspector
            write_train_records(args, rollout_id, groups, batch, [i for _, local, _ in plan for i in local],
                                first_step_log_probs)
        return read_metrics(metrics) if reports_metrics() else {}

    def _train_step(self, batch: TrainBatch, mbs: list, loss_fn, metrics: dict, routing=None, prefix: str = "train"):
        """`train_step` that skips the optimizer step when a loss or gradient on any rank is NaN or inf (counted in
        `<prefix>/skipped/<reason>` and logged), and stops the run if a step taken left a parameter non-finite,
        before such weights can reach the engines or a checkpoint. Returns train_step's (metrics, grad_norm, lr,
        skipped)."""
        guard = FiniteStepGuard(self.optimizer, self.model)
        out = train_step(self.args, self.model, guard, self.scheduler, batch, mbs, guard.watch(loss_fn),
                         routing=routing)
        if out[3]:  # skipped; with fp16 Megatron's loss scaler decides (it skips on non-finite gradients)
            reason = guard.reason or "non_finite_grad_norm"
            metrics[f"{prefix}/skipped/{reason}"] = metrics.get(f"{prefix}/skipped/{reason}", 0.0) + 1.0
            logger.warning("%s step %d skipped: %s", prefix, self.step, reason.replace("_", " "))
        else:
            check_finite_parameters(self.model, self.step)
        return out

    # ---- critic ---------------------------------------------------------------------------------------------
    def compute_values(self, groups: list[list[dict]]) -> dict[int, list[float]]:
        """Critic: this rank's samples' per-token values (last pipeline stage; {} elsewhere)."""
        batch = TrainBatch.from_samples(groups, self.args)
        mbs = [mb for _, _, m in self._split(batch, every_sample=True) for mb in m]
        return {i: v.tolist() for i, v in forward_values(self.args, self.model, batch, mbs).items()}

    def get_returns(self) -> list[list[float]] | None:
        return self.last_returns

    def train_critic(self, rollout_id: int, groups: list[list[dict]], values: dict, returns: list) -> dict:
        """Critic: value-loss steps against the actor's GAE returns, clipped around the rollout-time values."""
        args = self.args
        batch = TrainBatch.from_samples(groups, self.args)
        n = len(batch.tokens)
        batch.old_values = [torch.as_tensor(values[i], dtype=torch.float32) for i in range(n)]
        batch.returns = [torch.as_tensor(returns[i], dtype=torch.float32) for i in range(n)]
        plan = self._split(batch)
        metrics: dict[str, float] = {}
        for step, local, mbs in plan:
            loss_fn = make_value_loss_fn(args, batch, step_denominators(batch, step), scale=len(mbs) * self.dp_size)
            mb_metrics, grad_norm, _, skipped = self._train_step(batch, mbs, loss_fn, metrics, prefix="critic")
            metrics["critic/skipped_steps"] = metrics.get("critic/skipped_steps", 0.0) + float(skipped)
            for k, v in self._step_metrics(mb_metrics, len(mbs)).items():
                metrics[f"critic/{k}"] = metrics.get(f"critic/{k}", 0.0) + v / len(plan)
            metrics["critic/grad_norm"] = float(grad_norm or 0.0)
        return read_metrics(metrics) if reports_metrics() else {}

    # ---- colocated offload (--offload-train) ------------------------------------------------------------------
    def offload(self) -> int:
        """Move parameters, grad buffers, optimizer state and the KL reference to host memory; returns bytes."""
        from vime.trainer.offload import train_state_tensors

        ref = [t for state in (self.ref_state, self.teacher_state) for sd in state or [] for t in sd.values()]
        return self.offloader.offload(train_state_tensors(self.model, self.optimizer, ref))

    def onload(self) -> int:
        return self.offloader.onload()

    # ---- weights out ------------------------------------------------------------------------------------------
    def hf_weights(self):
        """(HF name, full tensor) pairs of the current policy, gathered over TP (for weight sync / export)."""
        from vime.trainer.megatron.hf_checkpoint import iter_hf_weights

        return iter_hf_weights(self.model, self.hf_config)

    def save(self, rollout_id: int, extra_state: dict | None = None) -> str:
        megatron = MegatronConfig.of(self.args)
        return str(save_checkpoint(self, megatron.save, rollout_id, extra_state))

    def save_hf(self, out_dir: str) -> str:
        """The policy as an HF checkpoint (LoRA: the merged weights, and the adapter alone in PEFT's format under
        `out_dir/adapter`; multi-LoRA: the base, and each adapter under `out_dir/adapter/<name>`). Collective."""
        job = JobConfig.of(self.args)
        from vime.trainer.megatron.hf_checkpoint import save_hf_checkpoint

        save_hf_checkpoint(self.model, job.hf_checkpoint, out_dir)
        if self.lora is not None:
            self._write_adapters(f"{out_dir}/adapter", one_per_directory=bool(self.lora.adapters))
        return out_dir

    def _write_adapters(self, root: str, one_per_directory: bool) -> None:
        """Each LoRA adapter as a PEFT adapter: in `root/<name>` (`one_per_directory`), or the only one in `root`.
        Collective."""
        job = JobConfig.of(self.args)
        from vime.trainer.megatron.hf_checkpoint import save_peft_adapter

        for name in self.lora.names:
            path = f"{root}/{name}" if one_per_directory else root
            save_peft_adapter(self.model, self.lora, str(job.hf_checkpoint), path, name)

    def get_loaded_state(self) -> dict | None:
        return self.loaded_state

    def set_plugin_values(self, values: dict) -> None:
        """The rollout manager's run-time values (router address, rollout count, ...) for custom functions."""
        self.plugin_args = plugin_view_from(self.args, values)

    def send_weights(self, transport, handle) -> None:
        """Hand `transport` this rank's weights (all ranks gather over tensor parallel, together) and, on the one
        rank per pipeline stage that writes them (data- and tensor-parallel rank 0), the stage. A transport that
        sends LoRA adapters gets each as a PEFT adapter written into `<handle>/<adapter name>`."""
        from vime.trainer.megatron.hf_checkpoint import stage_writer

        if getattr(transport, "sends_adapter", False):
            if self.lora is None:
                raise ValueError(f"{type(transport).__name__} sends LoRA adapters, and this model has none")
            self._write_adapters(handle, one_per_directory=True)  # what the engines' `adapter_dirs` reads
            return
        weights = list(self.hf_weights())
        stage, _, writes = stage_writer()
        transport.send(weights, stage if writes else None, handle)

    def compute_kind(self) -> tuple[str, str]:
        """(dtype, device type) this rank computes in, e.g. ("bfloat16", "cuda"): what the weight check's
        tolerance depends on, measured here rather than guessed by a driver that may have no GPU."""
        return str(_param_dtype(self.model)).removeprefix("torch."), self.device.type

    def probe_log_probs(self, tokens: list[int], response_length: int, temperature: float | None = None,
                        adapter: str | None = None) -> list[float]:
        """Log-probs of the last `response_length` tokens of one sequence under the current weights, at
        `temperature` (default: --rollout-temperature), through LoRA adapter `adapter` (default: the only one).
        [] on all but the last pipeline stage."""
        args = self.args
        names = self.lora.adapters if self.lora is not None else ()
        if adapter is not None and adapter not in names:
            raise ValueError(f"no LoRA adapter {adapter!r} in this model (adapters: {', '.join(names) or 'none'})")
        batch = TrainBatch(tokens=[tokens], response_lengths=[response_length],
                           adapters=[names.index(adapter)] if names else None)
        # LoRA computed as the engines compute it: the adapter beside the base (adapter sync), or merged into it
        merged = self.lora is not None and LoraConfig.of(args).lora_sync == "merged"
        with adapters_merged(self.model, adapter) if merged else contextlib.nullcontext():
            out = forward_log_probs(args, self.model, batch, [[0]], temperature=temperature)
        return out[0][0].tolist() if out else []


def _param_dtype(model) -> torch.dtype:
    return next(p for m in model for p in m.parameters()).dtype
