"""A training rank's half of the delta transport: the writer of each stage digests every HF tensor and writes the
vLLM layers in which any tensor changed since it last sent to this engine set."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from vime.transport.weights.base import Weights, WeightSender
from vime.transport.weights.disk.rank import tensor_bytes, write_stage_file

# HF projections that vLLM fuses into one layer: they must travel together
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def load_unit(name: str) -> str:
    """The vLLM layer an HF tensor loads into ("model.layers.0.self_attn.k_proj.weight" -> "...qkv_proj")."""
    module = name.rsplit(".", 1)[0]
    if ".experts." in module:
        return module.split(".experts.")[0] + ".experts"
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{_FUSED.get(leaf, leaf)}"


def digest(tensor: torch.Tensor) -> bytes:
    sha = hashlib.sha1(usedforsecurity=False)
    for piece in tensor_bytes(tensor):
        sha.update(piece)
    return sha.digest() + str((tensor.dtype, tuple(tensor.shape))).encode()


def changed_tensors(weights: list[tuple[str, torch.Tensor]], previous: dict[str, bytes]) -> tuple[list[str], dict]:
    """Names to send (every tensor of a layer in which any tensor changed or is new) and the new digests."""
    digests = {name: digest(t) for name, t in weights}
    dirty = {load_unit(name) for name, d in digests.items() if previous.get(name) != d}
    return [name for name, _ in weights if load_unit(name) in dirty], digests


class DeltaSender(WeightSender):
    def __init__(self) -> None:
        self.sent = {"key": None, "digests": {}}  # what the engine set of key "key" holds, from this writer

    def send(self, weights: Weights, stage: int | None, handle: dict) -> None:
        """The writer of each stage writes the tensors that changed since it last sent to this engine set."""
        if stage is None:
            return
        previous = self.sent["digests"] if self.sent["key"] == handle["key"] else {}
        names, digests = changed_tensors(weights, previous)
        if names:
            by_name = dict(weights)
            write_stage_file(Path(handle["dir"]), stage, [(n, by_name[n]) for n in names])
        self.sent = {"key": handle["key"], "digests": digests}
