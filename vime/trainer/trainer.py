"""One Megatron training rank: turns a rollout into optimizer steps.

    trainer = MegatronTrainer(args, rank, world_size, master_addr, master_port)   # one per process
    metrics = trainer.train(rollout_id, groups)                                    # groups of Sample dicts

Every rank reads the whole rollout from the data transport (its Ray actor, `vime.ray.actor_group`, does; the
rollout is small next to the model), turns it into a `TrainBatch` and derives the same step / data-parallel /
micro-batch split from it, so no scatter is needed. Per rollout: (optional) reference and old log-probs ->
advantages -> --num-steps-per-rollout optimizer steps. A step whose loss or gradients are NaN or inf on any rank is
skipped (train/skipped_steps, train/skipped/<reason>); a step that leaves a parameter non-finite stops the run.
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from vime.algorithms import compute_approx_kl, get_advantage_estimator, masked_mean_std
from vime.algorithms.distillation import opd_token_rewards
from vime.algorithms.shaping import entropy_coef_at, mask_truncated, overlong_penalties
from vime.backends.megatron_utils.checkpoint import load_checkpoint, save_checkpoint
from vime.backends.megatron_utils.device import collective_device, model_device
from vime.backends.megatron_utils.lora import (LoraConfig, adapters_merged, attach_lora, is_lora_parameter,
                                              load_peft_adapter)
from vime.backends.megatron_utils.model import setup_model_and_optimizer
from vime.trainer.batching import balanced_partition, micro_batches, step_slices
from vime.trainer.critic import attach_value_head, make_value_loss_fn
from vime.trainer.loss import make_loss_fn
from vime.trainer.moe_metrics import ExpertLoad, take_moe_losses
from vime.trainer.offload import TrainStateOffloader
from vime.trainer.passes import (OnHost, forward_log_probs, forward_values, is_last_stage, is_packed, prompt_sharing,
                                 train_step)
from vime.trainer.routing_replay import RoutingReplay, sample_routing
from vime.trainer.train_batch import TrainBatch
from vime.trainer.train_records import saves_train_records, write_train_records
from vime.utils.misc import load_function, with_values
from vime.utils.plugin_args import plugin_view_from

logger = logging.getLogger(__name__)

# estimators that need per-token log-probs (KL in the reward) rather than rewards alone
_PER_TOKEN_ESTIMATORS = {"reinforce_plus_plus", "ppo"}


class MegatronTrainer:
    def __init__(self, args, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, total_steps: int = 1000, role: str = "actor", local_rank: int = 0):
        from transformers import AutoConfig

        from vime.backends.megatron_utils.arguments import fill_architecture_from_hf, validate_megatron_args
        from vime.backends.megatron_utils.hf_checkpoint import load_hf_checkpoint_into_model
        from vime.backends.megatron_utils.parallel import init_parallel

        if world_size > 1 or master_port is not None:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                              MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        init_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, seed=args.seed,
                      expert_model_parallel_size=args.expert_model_parallel_size,
                      expert_tensor_parallel_size=args.expert_tensor_parallel_size)
        self.hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
        # the run's flags plus the architecture read from the checkpoint: this rank's own copy
        args = validate_megatron_args(fill_architecture_from_hf(args, self.hf_config), world_size=dist.get_world_size())
        self.args = args
        self.plugin_args = plugin_view_from(args, None)  # what custom functions get (`set_plugin_values`)
        self.role = role

        lora = LoraConfig.from_args(args) if role == "actor" else None  # the critic trains in full

        def prepare(chunks):
            load_hf_checkpoint_into_model(chunks, args.hf_checkpoint)
            if role == "critic":
                attach_value_head(chunks)
            elif lora is not None:  # a frozen base: only the adapters get grads and state
                for chunk in chunks:
                    attach_lora(chunk, lora)
                    if args.lora_load:
                        load_peft_adapter(chunk, args.lora_load)

        self.model, self.optimizer, self.scheduler = setup_model_and_optimizer(args, total_steps, prepare)
        self.device = model_device(self.model)  # where build_model_chunks put it (training_device)
        no_sharing = prompt_sharing(args, self.model)
        logger.info("training %s: micro-batches %s", role, "share each group's prompt" if no_sharing is None
                    else f"hold a copy of the prompt per sample (prompt sharing off: {no_sharing})")
        self.lora = lora
        self.expert_load = ExpertLoad(self.model, args.num_layers, args.num_experts) if args.num_experts else None
        self.step = 0
        self.offloader = TrainStateOffloader()  # --offload-train
        self.loaded_state = None
        self.last_returns = None
        # The reference policy for KL is the starting point: the HF checkpoint (or a converted `release`). With
        # LoRA the base is frozen, so the reference is the starting adapters alone (not a copy of the model).
        self.ref_state = self._snapshot(adapters_only=lora is not None) if self._needs_ref() else None
        self.teacher_state = self._teacher_snapshot() if self._needs_teacher() else None
        if args.load:
            self.loaded_state = load_checkpoint(self, args.load)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.saves_train_records = saves_train_records(args, role)  # its share of each rollout, for the inspector

    def _moe_metrics(self, num_micro_batches: int) -> dict:
        """The routers' losses and expert loads of the step just run ({} for dense models). Collective."""
        if self.expert_load is None:
            return {}
        return {**take_moe_losses(self.args, num_micro_batches, self.device), **self.expert_load.take()}

    # ---- reference weights (KL) -----------------------------------------------------------------------------
    def _needs_ref(self) -> bool:
        return self.role == "actor" and bool(self.args.use_kl_loss or self.args.kl_coef)

    def _needs_teacher(self) -> bool:
        return self.role == "actor" and getattr(self.args, "opd_teacher_checkpoint", None) is not None

    def _teacher_snapshot(self) -> list[dict[str, torch.Tensor]]:
        """The distillation teacher's weights in this rank's layout: loaded into the model, copied, swapped out."""
        from vime.backends.megatron_utils.hf_checkpoint import load_hf_checkpoint_into_model

        own = self._snapshot()
        try:
            load_hf_checkpoint_into_model(self.model, self.args.opd_teacher_checkpoint)
        except (KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"--opd-teacher-checkpoint {self.args.opd_teacher_checkpoint}: the teacher runs in the "
                             f"trainer and must have the student's architecture ({e})") from e
        teacher = self._snapshot()
        self._load(own)
        return teacher

    def _swapped_log_probs(self, states: dict, batch: TrainBatch, mbs: list, routing, phase) -> dict:
        """{name: log-probs of `batch`} under each of `states` ({name: weights}: reference, teacher), the policy's
        own weights put back after each. A state may hold only part of the model (a LoRA reference: the adapters;
        a teacher is whole): it is laid over the policy's own weights, never over another state's."""
        if not states:
            return {}
        current = self._snapshot(adapters_only=self.lora is not None and all(s is self.ref_state
                                                                              for s in states.values()))
        out = {}
        for name, state in states.items():
            self._load(state)
            with phase(name):
                out[name] = _dense(forward_log_probs(self.args, self.model, batch, mbs, routing=routing),
                                   len(batch.tokens))
            self._load(current)
        return out

    def _snapshot(self, adapters_only: bool = False) -> list[dict[str, torch.Tensor]]:
        """A copy of each chunk's state (`adapters_only`: its LoRA adapters); `_load` puts back what it holds."""
        return [{k: v.detach().clone() for k, v in m.module.state_dict().items()
                 if v is not None and (not adapters_only or is_lora_parameter(k))} for m in self.model]

    def _load(self, state: list[dict[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for m, sd in zip(self.model, state):
                own = m.module.state_dict()
                for k, v in sd.items():
                    own[k].copy_(v)

    # ---- data ------------------------------------------------------------------------------------------------
    def _split(self, batch: TrainBatch, every_sample: bool = False) -> list[tuple[range, list[int], list]]:
        """Per optimizer step: (the step's sample positions, this rank's share, its micro-batches). A sample with
        no trainable token (failed, aborted, fully masked) adds nothing to the loss, so it is left out of the
        micro-batches and never computed (`every_sample` keeps it: the critic's values cover every sample); a rank
        whose share is all such samples still runs one micro-batch, of zero loss, to take part in the step."""
        args = self.args
        lengths = [len(t) for t in batch.tokens]
        plan = []
        for step in step_slices(len(lengths), args.global_batch_size):
            local, mbs = self._rank_share(batch, step, lengths, self.dp_rank, every_sample)
            plan.append((step, local, mbs))
        return plan

    def _rank_share(self, batch: TrainBatch, step, lengths: list[int], dp_rank: int, every_sample: bool = False):
        """Data-parallel rank `dp_rank`'s samples of `step` and its micro-batches (every rank derives every rank's)."""
        args = self.args
        local = balanced_partition(list(step), lengths, self.dp_size)[dp_rank]
        computed = local if every_sample else [i for i in local if batch.loss_masks[i].any()] or local[:1]
        if args.use_dynamic_batch_size:
            return local, micro_batches(computed, lengths, max_tokens=args.max_tokens_per_gpu, packed=is_packed(args))
        return local, micro_batches(computed, lengths, micro_batch_size=args.micro_batch_size)

    def _step_micro_batches(self, batch: TrainBatch, step) -> int:
        """The micro-batches of `step` over all data-parallel ranks (--loss-agg-mode bnpo averages over them)."""
        lengths = [len(t) for t in batch.tokens]
        return sum(len(self._rank_share(batch, step, lengths, r)[1]) for r in range(self.dp_size))

    # ---- one rollout -----------------------------------------------------------------------------------------
    def train(self, rollout_id: int, groups: list[list[dict]], values: dict | None = None) -> dict[str, float]:
        """Actor: one rollout's optimizer steps. `values` ({sample index: per-token values}) come from the
        critic for --advantage-estimator ppo; the GAE returns are then kept in `last_returns` for it."""
        args = self.args
        # the trainer has trained `rollout_id` rollouts: its weights are the version an update would label so
        batch = TrainBatch.from_samples(groups, self.args, trainer_version=rollout_id)
        if values is not None:
            batch.values = [torch.as_tensor(values[i], dtype=torch.float32) for i in range(len(batch.tokens))]
        metrics: dict[str, float] = {}
        if args.mask_truncated_samples and args.loss_type != "sft_loss":  # before the split: they are not computed
            batch.loss_masks, masked = mask_truncated(batch.loss_masks, batch.truncated)
            metrics["train/truncated_masked_fraction"] = masked / max(1, batch.num_usable)
        if args.entropy_coef_schedule != "constant":
            args = with_values(args, entropy_coef=entropy_coef_at(
                rollout_id, self.args.entropy_coef, args.entropy_coef_final, args.entropy_coef_decay_rollouts,
                args.entropy_coef_schedule))
            metrics["train/entropy_coef"] = float(args.entropy_coef)
        plan = self._split(batch)
        all_local_mbs = [mb for _, _, mbs in plan for mb in mbs]
        # --use-rollout-logprobs: the engine's log-probs are the old policy; no forward pass for it
        bypass = getattr(args, "use_rollout_logprobs", False) and all(r is not None for r in batch.rollout_log_probs)
        needs_old = args.loss_type != "sft_loss" and (
            (len(plan) > 1 and not bypass) or (args.kl_coef and args.advantage_estimator in _PER_TOKEN_ESTIMATORS)
            or (self.teacher_state is not None and any(lp is None for lp in batch.rollout_log_probs)))
        routing = self._routing_replay(batch, first_pass=needs_old)
        phase = routing.phase if routing is not None else (lambda name: contextlib.nullcontext())
        states = {"reference": self.ref_state, "teacher": self.teacher_state} if args.loss_type != "sft_loss" else {}
        swapped = self._swapped_log_probs({k: v for k, v in states.items() if v is not None}, batch, all_local_mbs,
                                          routing, phase)
        batch.ref_log_probs, batch.teacher_log_probs = swapped.get("reference"), swapped.get("teacher")
        if needs_old:  # --use-routing-replay records this first pass's routing for the optimizer steps
            with phase("first_pass"):
                old = forward_log_probs(args, self.model, batch, all_local_mbs, routing=routing)
            batch.old_log_probs = _dense(old, len(batch.tokens))
        if args.loss_type != "sft_loss":
            metrics.update(self._compute_advantages(batch))
            # the estimator's own output, over the whole batch's trainable tokens (every rank holds all of it)
            metrics["train/advantage_mean"], metrics["train/advantage_std"] = masked_mean_std(batch.advantages,
                                                                                              batch.loss_masks)
            if batch.values is not None:
                metrics["train/return_mean"] = masked_mean_std(batch.returns, batch.loss_masks)[0]
            if self.teacher_state is not None and args.opd_mode == "reward":
                self._add_opd_rewards(batch)

        # the inspector's trainer log-probs: those of the first step's forward, under the rollout's weights, unless
        # the old log-probs were computed for all of them already
        first_step_log_probs = OnHost() if self.saves_train_records and batch.old_log_probs is None else None
        for step_index, (step, local, mbs) in enumerate(plan):
            denominators = _denominators(batch, step)
            if args.loss_agg_mode == "bnpo":
                denominators["micro_batches"] = self._step_micro_batches(batch, step)
            loss_fn = make_loss_fn(args, batch, denominators, scale=len(mbs) * self.dp_size,
                                   step_index=step_index, plugin_args=self.plugin_args,
                                   keep_log_probs=first_step_log_probs if step_index == 0 else None)
            with phase("steps"):
                mb_metrics, grad_norm, lr, skipped = self._train_step(batch, mbs, loss_fn, metrics, routing=routing)
            self.step += 1
            step_metrics = {**self._reduce(mb_metrics), **self._moe_metrics(len(mbs))}
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
        if getattr(args, "max_staleness", None) is not None:
            metrics["async/stale_samples_dropped"] = float(batch.stale)
        metrics["train/steps"] = float(len(plan))
        if self.saves_train_records:  # for the inspector
            write_train_records(args, rollout_id, groups, batch, [i for _, local, _ in plan for i in local],
                                first_step_log_probs)
        return read_metrics(metrics) if is_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 else {}

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

    def _routing_replay(self, batch: TrainBatch, first_pass: bool) -> RoutingReplay | None:
        """The rollout's MoE routing replay: the engine's routing (--use-rollout-routing-replay), the trainer's own
        as the first pass (`first_pass`: the old log-prob forward runs) records it (--use-routing-replay), or None."""
        args = self.args
        if getattr(args, "use_rollout_routing_replay", False):
            routing = RoutingReplay(self.model, args.num_layers, len(batch.tokens), given=True)
            for i, (tokens, routed) in enumerate(zip(batch.tokens, batch.rollout_routed_experts)):
                if routed is None and not batch.loss_masks[i].any():  # failed or aborted: computed, never trained
                    routed = np.zeros((0, args.num_layers, args.moe_router_topk), dtype=np.int64)
                routing.routing[i] = sample_routing(routed, len(tokens), args.num_layers, args.moe_router_topk, i,
                                                    args.num_experts)
            return routing
        if getattr(args, "use_routing_replay", False) and first_pass:
            return RoutingReplay(self.model, args.num_layers, len(batch.tokens))
        return None

    def _compute_advantages(self, batch: TrainBatch) -> dict[str, float]:
        """The estimator's advantages (and returns) into `batch`; returns the shaping's own metrics: the overlong
        penalties applied (--overlong-buffer-len) and the ReMax baselines (--advantage-estimator remax)."""
        args = self.args
        n = len(batch.tokens)
        metrics: dict[str, float] = {}
        rewards = batch.rewards
        usable = torch.tensor([bool(m.any()) for m in batch.loss_masks])
        n_usable = max(1, int(usable.sum()))
        if args.overlong_buffer_len is not None:  # DAPO's soft overlong punishment, added to the reward
            penalties = torch.tensor(overlong_penalties(batch.response_lengths, args.rollout_max_response_len,
                                                        args.overlong_buffer_len, args.overlong_penalty_factor))
            penalties = torch.where(usable, penalties, torch.zeros_like(penalties))
            rewards = rewards + penalties
            metrics["train/overlong_penalty_mean"] = float(penalties.sum()) / n_usable
            metrics["train/overlong_penalized_fraction"] = float((penalties < 0).sum()) / n_usable
        extra = {}
        if args.advantage_estimator == "remax" and not args.custom_advantage_function_path:
            if batch.greedy_rewards is None:
                raise ValueError("--advantage-estimator remax: no sample carries its greedy baseline reward "
                                 "(metadata['remax_greedy_reward']); the default rollout writes it, a custom rollout "
                                 "must too")
            extra["greedy_rewards"] = batch.greedy_rewards
            baselines = batch.greedy_rewards[usable & torch.isfinite(batch.greedy_rewards)]
            metrics["train/remax_greedy_reward_mean"] = float(baselines.mean()) if len(baselines) else 0.0
        if args.custom_advantage_function_path:
            estimator = load_function(args.custom_advantage_function_path)
        else:
            estimator = get_advantage_estimator(args.advantage_estimator)
        kl = None
        group_size = args.n_samples_per_prompt
        if args.kl_coef and args.advantage_estimator in _PER_TOKEN_ESTIMATORS and batch.ref_log_probs is not None:
            kl = [compute_approx_kl(o, r, args.kl_loss_type) if o is not None and r is not None
                  else torch.zeros(batch.response_lengths[i])
                  for i, (o, r) in enumerate(zip(batch.old_log_probs, batch.ref_log_probs))]

        def estimate(rows: list[int]):
            def pick(values):
                return None if values is None else [values[i] for i in rows]

            return estimator(
                rewards=rewards[rows], loss_masks=pick(batch.loss_masks), n_samples_per_prompt=group_size,
                kl=pick(kl), values=pick(batch.values), kl_coef=args.kl_coef, gamma=args.gamma, lambd=args.lambd,
                normalize_std=not args.disable_grpo_std_normalization,
                normalize_advantages=args.normalize_advantages, eps=args.advantage_eps,
                **{k: v[rows] for k, v in extra.items()})

        # multi-LoRA: each adapter's advantages from its own samples only (a batch-wide baseline or whitening
        # would mix two tasks' reward scales); its groups stay whole, as the data source hands out whole groups
        parts = [list(range(n))] if batch.adapters is None else \
            [[i for i, a in enumerate(batch.adapters) if a == k] for k in sorted(set(batch.adapters))]
        batch.advantages, batch.returns = [None] * n, [None] * n
        for rows in parts:
            advantages, returns = estimate(rows)
            for i, a, r in zip(rows, advantages, returns):
                batch.advantages[i], batch.returns[i] = a, r
        assert all(a is not None for a in batch.advantages)
        self.last_returns = [r.tolist() for r in batch.returns] if batch.values is not None else None
        return metrics

    def _add_opd_rewards(self, batch: TrainBatch) -> None:
        """--opd-mode reward: each of this rank's samples gets the teacher's per-token reward on top of its
        advantages (the teacher scored only this rank's samples; the others are not trained here)."""
        local = [i for i, teacher in enumerate(batch.teacher_log_probs) if teacher is not None]
        rewards = opd_token_rewards([batch.sampling_log_probs(i) for i in local],
                                    [batch.teacher_log_probs[i] for i in local],
                                    [batch.loss_masks[i] for i in local], self.args.opd_coef)
        for i, reward in zip(local, rewards):
            batch.advantages[i] = batch.advantages[i] + reward

    def _reduce(self, mb_metrics: list[dict]) -> dict[str, torch.Tensor]:
        """Sum the micro-batch shares (the max for `_MAX_METRICS`), then over data-parallel ranks (last stage
        only): 0-dim tensors, not read here (`read_metrics` reads a rollout's metrics at once). The all-reduce
        takes them on the device its group serves: Megatron's data-parallel group on GPUs is NCCL only."""
        if not is_last_stage() or not mb_metrics:
            return {}
        group = parallel_state.get_data_parallel_group()
        keys = sorted(mb_metrics[0])
        sums, maxes = metric_totals(mb_metrics, keys, collective_device(group, self.device))
        if self.dp_size > 1:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        return {k: maxes[j] if k in _MAX_METRICS else sums[j] for j, k in enumerate(keys)}

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
            loss_fn = make_value_loss_fn(args, batch, _denominators(batch, step), scale=len(mbs) * self.dp_size)
            mb_metrics, grad_norm, _, skipped = self._train_step(batch, mbs, loss_fn, metrics, prefix="critic")
            metrics["critic/skipped_steps"] = metrics.get("critic/skipped_steps", 0.0) + float(skipped)
            for k, v in {**self._reduce(mb_metrics), **self._moe_metrics(len(mbs))}.items():
                metrics[f"critic/{k}"] = metrics.get(f"critic/{k}", 0.0) + v / len(plan)
            metrics["critic/grad_norm"] = float(grad_norm or 0.0)
        return read_metrics(metrics) if is_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 else {}

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
        from vime.backends.megatron_utils.hf_checkpoint import iter_hf_weights

        return iter_hf_weights(self.model, self.hf_config)

    def save(self, rollout_id: int, extra_state: dict | None = None) -> str:
        return str(save_checkpoint(self, self.args.save, rollout_id, extra_state))

    def save_hf(self, out_dir: str) -> str:
        """The policy as an HF checkpoint (LoRA: the merged weights, and the adapter alone in PEFT's format under
        `out_dir/adapter`; multi-LoRA: the base, and each adapter under `out_dir/adapter/<name>`). Collective."""
        from vime.backends.megatron_utils.hf_checkpoint import save_hf_checkpoint

        save_hf_checkpoint(self.model, self.args.hf_checkpoint, out_dir)
        if self.lora is not None:
            self._write_adapters(f"{out_dir}/adapter", one_per_directory=bool(self.lora.adapters))
        return out_dir

    def _write_adapters(self, root: str, one_per_directory: bool) -> None:
        """Each LoRA adapter as a PEFT adapter: in `root/<name>` (`one_per_directory`), or the only one in `root`.
        Collective."""
        from vime.backends.megatron_utils.hf_checkpoint import save_peft_adapter

        for name in self.lora.names:
            path = f"{root}/{name}" if one_per_directory else root
            save_peft_adapter(self.model, self.lora, str(self.args.hf_checkpoint), path, name)

    def get_loaded_state(self) -> dict | None:
        return self.loaded_state

    def set_plugin_values(self, values: dict) -> None:
        """The rollout manager's run-time values (router address, rollout count, ...) for custom functions."""
        self.plugin_args = plugin_view_from(self.args, values)

    def send_weights(self, transport, handle) -> None:
        """Hand `transport` this rank's weights (all ranks gather over tensor parallel, together) and, on the one
        rank per pipeline stage that writes them (data- and tensor-parallel rank 0), the stage. A transport that
        sends LoRA adapters gets each as a PEFT adapter written into `<handle>/<adapter name>`."""
        from vime.backends.megatron_utils.hf_checkpoint import stage_writer

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
        if temperature is not None:
            args = with_values(args, rollout_temperature=temperature)
        names = self.lora.adapters if self.lora is not None else ()
        if adapter is not None and adapter not in names:
            raise ValueError(f"no LoRA adapter {adapter!r} in this model (adapters: {', '.join(names) or 'none'})")
        batch = TrainBatch(tokens=[tokens], response_lengths=[response_length],
                           adapters=[names.index(adapter)] if names else None)
        # LoRA computed as the engines compute it: the adapter beside the base (adapter sync), or merged into it
        merged = self.lora is not None and args.lora_sync == "merged"
        with adapters_merged(self.model, adapter) if merged else contextlib.nullcontext():
            out = forward_log_probs(args, self.model, batch, [[0]])
        return out[0][0].tolist() if out else []


class FiniteStepGuard:
    """The optimizer as `train_step` sees it for one step: `step()` is skipped, as Megatron skips an fp16 overflow
    (returns (False, None, None)), when a loss (`watch`) or a gradient on any rank is NaN or inf. bf16 and fp32
    have no loss scaler to catch them, and one such step writes NaN into every weight. With a loss scaler (fp16)
    Megatron's own check runs instead: it must see the overflow to lower the scale."""

    def __init__(self, optimizer, model):
        self.optimizer, self.model = optimizer, model
        self.non_finite_loss: torch.Tensor | bool = False  # a flag on the loss's device, read once in `step`
        self.reason: str | None = None  # why the step was skipped

    def __getattr__(self, name):  # zero_grad, param_groups, ...: the optimizer's own
        return getattr(self.optimizer, name)

    def watch(self, loss_fn):
        def watched(indices, inputs, output):
            loss, metrics = loss_fn(indices, inputs, output)
            self.non_finite_loss = ~torch.isfinite(loss.detach()).all() | self.non_finite_loss  # no host sync
            return loss, metrics

        return watched

    def step(self):
        if not _has_loss_scaler(self.optimizer):
            self.reason = non_finite_step_reason(self.model, self.non_finite_loss)
            if self.reason is not None:
                return False, None, None
        return self.optimizer.step()


def _has_loss_scaler(optimizer) -> bool:
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(getattr(o, "grad_scaler", None) is not None for o in optimizers)


def _any_rank(flags: list, device) -> list[bool]:
    """Each flag (a bool, or a 0-dim tensor on `device`) OR-ed over every rank (all ranks must agree to skip or
    stop, or the next collective hangs); read with one host sync."""
    t = torch.stack([torch.as_tensor(f, device=device).reshape(()).float() for f in flags])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def _param_dtype(model) -> torch.dtype:
    return next(p for m in model for p in m.parameters()).dtype


def _device(model) -> torch.device:
    return next(p for m in model for p in m.parameters()).device


def non_finite_step_reason(model, non_finite_loss) -> str | None:
    """Why this step's gradients must not be applied ("non_finite_loss", "non_finite_grad_norm"), or None; the
    same answer on every rank. Reads the gradients Megatron's DDP accumulated (`main_grad`). Collective."""
    grads = [p.main_grad for m in model for p in m.parameters() if getattr(p, "main_grad", None) is not None]
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else True
    loss_bad, grad_bad = _any_rank([non_finite_loss, ~finite if grads else False], _device(model))
    return "non_finite_loss" if loss_bad else "non_finite_grad_norm" if grad_bad else None


def check_finite_parameters(model, step: int) -> None:
    """Raise if a parameter holds NaN or inf after optimizer step `step`: stop before such weights are sent to the
    engines or saved. Collective (every rank raises together)."""
    named = [(name, p) for m in model for name, p in m.named_parameters()]
    finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()  # one device sync, not one a tensor
    bad = next((name for (name, _), ok in zip(named, finite) if not ok), None)
    if _any_rank([bad is not None], _device(model))[0]:
        where = f"parameter {bad}" if bad else "a parameter on another rank"
        raise RuntimeError(f"optimizer step {step} left {where} non-finite (NaN or inf) although its loss and "
                           "gradients were finite; the run stops before these weights reach the engines or a "
                           "checkpoint. Lower --lr or raise --adam-eps, or resume from the last checkpoint")


# step metrics reduced by their maximum (the others are shares of a global mean: summed)
_MAX_METRICS = frozenset({"logprob_diff_max"})


def metric_totals(mb_metrics: list[dict], keys: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(keys)] sums and maxima over the micro-batches of each metric (a tensor on any device, or a number a
    custom loss returned), on `device`: copies, no host sync."""
    table = torch.stack([torch.stack([torch.as_tensor(m[k]).detach().float().reshape(()).to(device, non_blocking=True)
                                      for k in keys]) for m in mb_metrics])
    return table.sum(dim=0), table.amax(dim=0)


def read_metrics(metrics: dict) -> dict[str, float]:
    """A rollout's metrics as floats, the tensors among them read with one host copy per device."""
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    for device in {v.device for v in tensors.values()}:
        names = [k for k, v in tensors.items() if v.device == device]
        out.update(zip(names, torch.stack([tensors[k].detach().float().reshape(()) for k in names]).tolist()))
    return {k: out[k] for k in metrics}


def _denominators(batch: TrainBatch, step) -> dict:
    """Trainable tokens and sequences of one optimizer step, over all data-parallel ranks (global means)."""
    return {"tokens": max(1.0, float(sum(batch.loss_masks[i].sum() for i in step))),
            "sequences": max(1, sum(int(batch.loss_masks[i].sum() > 0) for i in step))}


def _dense(by_index: dict, n: int) -> list:
    return [by_index[i][0] if i in by_index else None for i in range(n)]
