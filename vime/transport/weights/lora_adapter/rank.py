"""A training rank's half of the LoRA adapter sync: the trainer writes its adapters into the update directory
itself (`Trainer.send_weights`, one PEFT adapter per name), so this half only says so."""

from __future__ import annotations

from vime.transport.weights.base import Weights, WeightSender


class LoraAdapterSender(WeightSender):
    sends_adapter = True  # the trainers write the adapters (`Trainer.send_weights`), not the merged weights

    def send(self, weights: Weights, stage: int | None, handle: str) -> None:
        raise TypeError("the LoRA adapter sync sends adapters, written by the trainer itself, not merged weights")
