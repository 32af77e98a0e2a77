"""A weight update into the speculative drafter of an engine started with `--vllm-speculative-config
'{"method": "mtp", ...}'`, in the same worker call as the policy's (`worker_extension.WeightReceiver._vime_load`),
so the drafter serves the same weight version as the model it drafts for.

vLLM builds the MTP drafter as a model of its own (`model_runner.get_draft_model()`: e.g. `Glm4MoeMTP`), which
shares the policy's embedding, output layer and rotary tables (the same modules) and owns its MTP layers. The
policy's `load_weights` skips the MTP tensors of an update (HF names `model.layers.{N+k}.*` after its N decoder
layers; Qwen3-Next's and Qwen3.5's `mtp.*`): `split` sets them aside while the policy loads, and `load` gives them
to the drafter's own `load_weights` through vLLM's layer-by-layer reload, restricted to the layers the drafter
owns (the shared ones are the policy's, already loaded).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def draft_model(model_runner) -> torch.nn.Module | None:
    """The runner's speculative drafter when it is a model with weights of its own (MTP, EAGLE), else None."""
    get = getattr(model_runner, "get_draft_model", None)
    return get() if callable(get) else None


def is_draft_weight(name: str, num_hidden_layers: int) -> bool:
    """Whether the HF tensor `name` belongs to an MTP layer: past the decoder's layers, or under `mtp.`."""
    match = _LAYER.match(name)
    return name.startswith("mtp.") or (match is not None and int(match.group(1)) >= num_hidden_layers)


class DraftSplit:
    """Iterates `weights` minus the drafter's tensors, which it keeps in `.draft` as they pass."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], num_hidden_layers: int):
        self._weights, self._layers = iter(weights), num_hidden_layers
        self.draft: list[tuple[str, torch.Tensor]] = []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._weights:
            if is_draft_weight(name, self._layers):
                self.draft.append((name, tensor))
            else:
                yield name, tensor

    def drain(self) -> None:
        """Read what the policy's loader left (the broadcast must finish; MTP tensors may come last)."""
        for _ in self:
            pass


class _OwnLayers:
    """What vLLM's layerwise reload walks (`.modules()`): the drafter's modules that the policy does not share."""

    def __init__(self, draft: torch.nn.Module, policy: torch.nn.Module):
        shared = {id(m) for m in policy.modules()}
        self._modules = [m for m in draft.modules() if id(m) not in shared]

    def modules(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules)


def load(vllm_config, policy: torch.nn.Module, draft: torch.nn.Module,
         weights: list[tuple[str, torch.Tensor]]) -> int:
    """Load the MTP tensors `weights` into `draft`; returns how many."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from vime.engine.in_vllm.weight_loading import packing_cpu_experts

    if not weights:
        return 0
    own = _OwnLayers(draft, policy)
    draft_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config), packing_cpu_experts(draft):
        initialize_layerwise_reload(own)
        draft.load_weights(iter(weights))
        finalize_layerwise_reload(own, draft_config)
    return len(weights)
