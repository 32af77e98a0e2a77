"""What one training rank holds of a rollout: per-sample tensors, filled in stage by stage.

    batch = TrainBatch.from_samples(groups, args)     # tokens, masks, rewards, rollout log-probs
    batch.old_log_probs = ...                          # the trainer adds what each stage computes
    custom_loss(args, batch.select(indices, device), ...)  # a plain dict of the micro-batch's samples, on device

Every per-sample field is a list indexed by the sample's position in the rollout (None where not computed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from vime.algorithms.names import REMAX_GREEDY_REWARD_KEY
from vime.config.rollout import RewardConfig
from vime.config.train import RoutingReplayConfig, TrainLoopConfig
from vime.data.sample import ADAPTER_KEY, Sample, reward_value
from vime.data.weight_versions import too_stale
from vime.utils.lora_adapters import adapter_names


TRUNCATED = Sample.Status.TRUNCATED.value
UNTRAINABLE = frozenset({Sample.Status.FAILED.value, Sample.Status.ABORTED.value})  # statuses whose tokens train not


@dataclass
class TrainBatch:
    tokens: list[list[int]]
    response_lengths: list[int]
    # 1 where a response token is trained; all 0 for a sample with no usable reward (failed, aborted)
    loss_masks: list[torch.Tensor] = field(default_factory=list)
    rewards: torch.Tensor | None = None  # [n] scalar rewards (0 where unusable)
    rollout_log_probs: list[torch.Tensor | None] = field(default_factory=list)  # the engine's, per response token
    num_usable: int = 0
    # computed on the trainer side (stages of one rollout)
    ref_log_probs: list[torch.Tensor | None] | None = None  # the reference policy's (KL)
    teacher_log_probs: list[torch.Tensor | None] | None = None  # the distillation teacher's (--opd-*)
    old_log_probs: list[torch.Tensor | None] | None = None  # the policy's before this rollout's first step
    values: list[torch.Tensor] | None = None  # PPO: the critic's values at rollout time (actor side)
    advantages: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None
    old_values: list[torch.Tensor] | None = None  # PPO: the critic's own values at rollout time (critic side)
    # --use-rollout-routing-replay: the engine's routing per sample ([tokens - 1, layers, top-k] arrays, or None)
    rollout_routed_experts: list | None = None
    # --lora-adapters: each sample's adapter, as its index in that flag's order (None: one adapter or none)
    adapters: list[int] | None = None
    truncated: list[bool] = field(default_factory=list)  # cut at the length limit (--mask-truncated-samples)
    # --advantage-estimator remax: the reward of each sample's group's greedy response (NaN: none), else None
    greedy_rewards: torch.Tensor | None = None
    stale: int = 0  # samples left out for --max-staleness

    @classmethod
    def from_samples(cls, groups: list[list[dict]], args, trainer_version: int | None = None) -> TrainBatch:
        """Groups of `Sample` dicts, as the data transport decoded and checked them (`sample_codec`), -> a batch,
        one column per field (no `Sample` is rebuilt or checked again). A failed or aborted sample, or one without
        a finite reward (the default rollout fails NaN and inf rewards; a custom rollout may not), keeps its place
        (indices stay those of the rollout) with an all-zero loss mask and reward 0. So does, with --max-staleness
        K, a sample with a token sampled more than K versions before `trainer_version` (`stale`)."""
        train_loop = TrainLoopConfig.of(args)
        routing_replay = RoutingReplayConfig.of(args)
        reward_key = RewardConfig.of(args).reward_key
        samples = [d for g in groups for d in g]
        lengths = [d.get("response_length", 0) for d in samples]
        stale = [trainer_version is not None and too_stale(d, trainer_version, train_loop.max_staleness)
                 for d in samples]
        rewards = [None if d.get("reward") is None else reward_value(d["reward"], reward_key, d.get("index"))
                   for d in samples]
        usable = [d.get("status") not in UNTRAINABLE and r is not None and math.isfinite(r) and not old
                  for d, r, old in zip(samples, rewards, stale)]
        masks = []
        for d, n, ok in zip(samples, lengths, usable):
            mask = d.get("loss_mask") if d.get("loss_mask") is not None else [1] * n
            masks.append(torch.tensor(mask if ok else [0] * n, dtype=torch.float32))
        return cls(
            tokens=[d.get("tokens", []) for d in samples],
            response_lengths=lengths,
            loss_masks=masks,
            rewards=torch.tensor([r if ok else 0.0 for r, ok in zip(rewards, usable)]),
            rollout_log_probs=[torch.tensor(d["rollout_log_probs"], dtype=torch.float32)
                               if d.get("rollout_log_probs") is not None else None for d in samples],
            num_usable=sum(usable),
            rollout_routed_experts=[d.get("rollout_routed_experts") for d in samples]
            if routing_replay.use_rollout_routing_replay else None,
            adapters=sample_adapters(samples, adapter_names(args)),
            truncated=[d.get("status") == TRUNCATED for d in samples],
            greedy_rewards=greedy_rewards(samples),
            stale=sum(stale),
        )

    def sampling_log_probs(self, i: int) -> torch.Tensor:
        """Sample i's log-probs under the policy that sampled it: the engine's, or (none returned) the trainer's
        before this rollout's first step (`old_log_probs`; the trainer computes them when some are missing)."""
        return self.rollout_log_probs[i] if self.rollout_log_probs[i] is not None else self.old_log_probs[i]

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: list[int], device: torch.device | str | None = None) -> dict[str, list]:
        """The per-sample fields that are set, for `indices` only (what a loss, built in or custom, receives).
        `device`: their tensors copied there, the device of the model's output, once per micro-batch and without
        blocking (None: as held, on the CPU)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and value:
                out[f.name] = [_on_device(value[i], device) for i in indices]
        return out


def greedy_rewards(samples: list[dict]) -> torch.Tensor | None:
    """Each sample's ReMax baseline (`metadata[REMAX_GREEDY_REWARD_KEY]`, NaN where missing or None); None when no
    sample carries one."""
    values = [(s.get("metadata") or {}).get(REMAX_GREEDY_REWARD_KEY) for s in samples]
    if all(v is None for v in values):
        return None
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)


def _on_device(value, device):
    if device is None or not isinstance(value, torch.Tensor):
        return value
    return value.to(device, non_blocking=True)


def sample_adapters(samples: list[dict], names: list[str]) -> list[int] | None:
    """Each sample's adapter as its index in `names` (--lora-adapters); None without that flag. A sample that names
    no adapter of the run (a custom rollout that did not keep `metadata[ADAPTER_KEY]`) is an error."""
    if not names:
        return None
    index = {name: k for k, name in enumerate(names)}
    out = []
    for s in samples:
        name = (s.get("metadata") or {}).get(ADAPTER_KEY)
        if name not in index:
            raise ValueError(f"sample {s.get('index')}: metadata[{ADAPTER_KEY!r}] is {name!r}, not one of the run's "
                             f"--lora-adapters ({', '.join(names)}); a custom rollout must keep each sample's "
                             "metadata from the data source")
        out.append(index[name])
    return out
