"""MoE routing replay: the trainer routes each token to given experts instead of its own top-k.

- `--use-rollout-routing-replay`: the experts the engine routed each token to (`Sample.rollout_routed_experts`,
  prompt and response) in every forward of the rollout (reference, old log-probs, training), so the trainer
  computes the policy the engine sampled from: a near tie between two experts' router logits, which the engine
  and the trainer break differently, no longer sends a token through other experts.
- `--use-routing-replay`: the trainer's own routing of the rollout's first pass (the old log-prob forward) in its
  optimizer steps, so every step of a rollout trains the same experts per token.

The router probabilities are still computed (gathered at the replayed experts), so gradients reach the router.
Megatron-core's `RouterReplay` does the replacing (`moe_enable_routing_replay`); this module hands each router
its [tokens, top-k] indices for one micro-batch, in the order the model flattens it: packed (thd) sequences one
after another, right-padded (bshd) [seq, batch] seq-major. Routing is per sample [tokens, layers, top-k] with
layers counted over the whole model (dense layers' rows unused), as vLLM returns it.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from vime.backends.megatron_utils.hf_architecture import hf_moe


def add_routing_replay_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("MoE routing replay")
    g.add_argument("--use-rollout-routing-replay", action="store_true", default=False,
                   help="MoE models: the engines return the experts they routed each token to, and every trainer "
                        "forward of the rollout replays them, so the trainer computes the policy the engine sampled "
                        "from (default: off).")
    g.add_argument("--use-routing-replay", action="store_true", default=False,
                   help="MoE models: record the trainer's routing in the rollout's first forward (old log-probs) and "
                        "replay it in the rollout's optimizer steps (default: off; --use-rollout-routing-replay, "
                        "which replays the engine's routing everywhere, takes precedence).")


def validate_routing_replay_args(args: argparse.Namespace, hf_config=None) -> None:
    """Parse-time checks. `hf_config`: the checkpoint's (read from --hf-checkpoint when None and a flag is set)."""
    flags = [f for f in ("use_rollout_routing_replay", "use_routing_replay") if getattr(args, f, False)]
    if not flags:
        return
    if hf_config is None:
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
        except Exception as e:  # transformers' own checks raise KeyError, ValueError, OSError, ...
            raise ValueError(f"--hf-checkpoint {args.hf_checkpoint}: transformers cannot read its config.json "
                             f"({type(e).__name__}: {e})") from e
    names = " and ".join("--" + f.replace("_", "-") for f in flags)
    if not hf_moe(hf_config)["num_experts"]:
        raise ValueError(f"{names}: {args.hf_checkpoint} is a dense model (no routed experts in its config.json); "
                         "routing replay is for MoE models, drop the flag")
    if getattr(args, "use_rollout_routing_replay", False):
        from vime.utils.device import use_gpu

        if not use_gpu() and args.rollout_num_gpus_per_engine != 1:
            raise ValueError("--use-rollout-routing-replay on CPU: vime captures the routing in the engine's "
                             "worker, for engines of one worker; set --rollout-num-gpus-per-engine 1")


@dataclass
class RouterSlot:
    layer: int  # 0-based layer of the whole model (vLLM's layer_id, Megatron's layer_number - 1)
    replay: object  # megatron.core.transformer.moe.router_replay.RouterReplay
    topk: int


def model_routers(model) -> list[RouterSlot]:
    """This rank's MoE routers with replay enabled, in model order (chunks, then layers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    slots = []
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise RuntimeError("routing replay: this model's routers were built without "
                                       "moe_enable_routing_replay (model_provider._moe_config sets it with the flags)")
                slots.append(RouterSlot(module.layer_number - 1, module.router_replay, module.topk))
    return slots


def sample_routing(routed: np.ndarray | list | None, num_tokens: int, num_layers: int, topk: int,
                   index: int, num_experts: int | None = None) -> torch.Tensor:
    """One sample's engine routing as [num_tokens, layers, top-k] (uint8 or int32, as compact as the ids allow):
    the engine's rows ([<= num_tokens - 1, ...]: it never forwards the last sampled token) and, for the positions
    it did not forward, experts 0..k-1. Those positions come after every token the engine generated from, so no
    trained log-prob depends on them."""
    if routed is None:
        raise ValueError(f"--use-rollout-routing-replay: sample {index} carries no routed experts (the engine "
                         "returned none); see vime.rollout.vllm_rollout.check_routed_experts")
    array = np.asarray(routed)
    rows = torch.as_tensor(array if array.dtype == np.uint8 else array.astype(np.int32))
    if rows.ndim != 3 or rows.shape[1] != num_layers or rows.shape[2] != topk or rows.shape[0] > num_tokens:
        raise ValueError(f"--use-rollout-routing-replay: sample {index} has routed experts of shape "
                         f"{tuple(rows.shape)}, expected [<= {num_tokens}, {num_layers}, {topk}] (tokens, layers, "
                         "top-k): was it generated by another model?")
    if num_experts is not None and rows.numel() and int(rows.max()) >= num_experts:
        raise ValueError(f"--use-rollout-routing-replay: sample {index} routes to expert {int(rows.max())}, but the "
                         f"model has {num_experts}: was it generated by another model?")
    if rows.shape[0] == num_tokens:
        return rows
    pad = torch.arange(topk, dtype=rows.dtype).expand(num_tokens - rows.shape[0], num_layers, topk)
    return torch.cat([rows, pad])


def micro_batch_routing(per_sample: list[torch.Tensor], layers: list[int], packed: bool) -> list[torch.Tensor]:
    """Per layer in `layers`: the [tokens, top-k] indices of one micro-batch in the model's flattened order.

    per_sample: [len_i, all layers, top-k] for each sample of the micro-batch, in micro-batch order. Packed: the
    samples' rows one after another. Padded: [longest, batch] flattened seq-major (row s * batch + b), padding
    positions routed to experts 0..k-1."""
    if packed:
        flat = torch.cat([r.long() for r in per_sample])  # [T, layers, k]
        return [flat[:, layer].contiguous() for layer in layers]
    batch, longest = len(per_sample), max(r.shape[0] for r in per_sample)
    num_layers, topk = per_sample[0].shape[1:]
    grid = torch.arange(topk).expand(longest, batch, num_layers, topk).clone()
    for b, rows in enumerate(per_sample):
        grid[:rows.shape[0], b] = rows.long()
    return [grid[:, :, layer].reshape(longest * batch, topk) for layer in layers]


class RoutingReplay:
    """What the forwards of one rollout do with this rank's routers: replay per-sample routing, or record it.

    `routing` holds per sample [tokens, all layers, top-k] indices (None where unknown); `recording()` fills it
    from the routers' own choices, `replaying()` feeds it back. Used by `model.run_schedule` around each micro-batch."""

    def __init__(self, model, num_layers: int, num_samples: int, given: bool = False):
        self.slots = model_routers(model)
        self.num_layers = num_layers
        self.routing: list[torch.Tensor | None] = [None] * num_samples
        self.given = given  # True: `routing` is the engine's, filled by the caller; False: recorded here
        self.mode: str | None = None  # "record", "replay" or None (the routers' own top-k)

    def phase(self, name: str):
        """The context for the forwards of one phase of a rollout: "reference" (the KL reference policy),
        "first_pass" (the old log-probs) or "steps" (the optimizer steps). Given routing is replayed in all three;
        the trainer's own is recorded in the first pass and replayed in the steps."""
        if self.given or name == "steps":
            return self.replaying()
        return self.recording() if name == "first_pass" else contextlib.nullcontext()

    @contextlib.contextmanager
    def recording(self):
        with self._mode("record"):
            yield

    @contextlib.contextmanager
    def replaying(self):
        with self._mode("replay"):
            yield

    @contextlib.contextmanager
    def _mode(self, mode: str):
        self.mode = mode
        try:
            yield
        finally:
            self.mode = None
            self._clear()

    @contextlib.contextmanager
    def micro_batch(self, indices: list[int], lengths: list[int], packed: bool):
        """Around one micro-batch's forward (samples `indices` of lengths `lengths`)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.mode is None or not self.slots:
            yield
            return
        layers = [s.layer for s in self.slots]
        if self.mode == "replay":
            targets = micro_batch_routing([self.routing[i] for i in indices], layers, packed)
            for slot, target in zip(self.slots, targets):
                slot.replay.clear_indices()
                slot.replay.set_target_indices(target.to(_device()))
                slot.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            for slot in self.slots:
                slot.replay.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield
        finally:
            if self.mode == "record":
                self._store([s.replay.get_recorded_indices() for s in self.slots], indices, lengths, packed)
            for slot in self.slots:
                slot.replay.clear_router_replay_action()

    def _store(self, recorded: list[torch.Tensor], indices: list[int], lengths: list[int], packed: bool) -> None:
        topk = self.slots[0].topk
        for pos, (i, n) in enumerate(zip(indices, lengths)):
            if self.routing[i] is None:
                self.routing[i] = torch.arange(topk, dtype=torch.int32).expand(n, self.num_layers, topk).clone()
        batch = len(indices)
        for slot, rows in zip(self.slots, recorded):
            rows = rows.detach().cpu().to(torch.int32)
            if packed:
                for i, part in zip(indices, rows.split(lengths)):
                    self.routing[i][:, slot.layer] = part
            else:
                grid = rows.view(-1, batch, topk)
                for b, (i, n) in enumerate(zip(indices, lengths)):
                    self.routing[i][:, slot.layer] = grid[:n, b]

    def _clear(self) -> None:
        for slot in self.slots:
            slot.replay.clear_indices()
            slot.replay.clear_router_replay_action()


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
