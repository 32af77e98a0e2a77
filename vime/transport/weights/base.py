"""What every weight transport is: the trainer's weights into running engines, in three places, each its own half.

- `TransportDriver`, in the driver (one for the run, `vime.driver.weight_sync.WeightSync`): `connect` to the engines,
  `prepare` the handle of one update, `cleanup` what it left. The rollout manager gets a copy with each update:
  `load_calls` names the worker method each engine runs to load it, `bound_engines` the engine set a collective
  update was made for.
- `WeightSender`, on each training rank (one per kind for the run, held by its actor): `send` gets the rank's
  weights and whether it writes; it never reaches into the trainer or Megatron's parallel state. State that must
  outlive an update (a process group, what the engines already hold, memory engines map) lives on it.
- The engine's half runs inside vLLM: `vime.engine.in_vllm.worker_extension` (the worker methods `load_calls` names).

The halves share nothing but the handle (plain data, made by `prepare`) and `vime.engine.protocol`. A driver
half is made from the run's `DriverSetup`; a sender from nothing (what it needs arrives with each handle).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from vime.config.rollout import EnginesConfig
from vime.config.train import MegatronConfig, WeightSyncConfig

if TYPE_CHECKING:  # annotations only: a driver half imports no torch
    import torch

Weights = list[tuple[str, "torch.Tensor"]]  # (HF name, tensor) of one pipeline stage, gathered over tensor parallel


@dataclasses.dataclass(frozen=True)
class DriverSetup:
    """What a driver half is made with (`make_driver`): the sections of the run it may read, each driver the ones
    it needs. A field left out is its section's defaults (tests and benches give the one a driver reads)."""

    weight_sync: WeightSyncConfig = WeightSyncConfig()  # the weight root, the broadcast's bucket size
    megatron: MegatronConfig = MegatronConfig()  # the pipeline stages: one sender each
    engines: EnginesConfig = EnginesConfig()  # the workers of each engine
    # the engines run vime's worker methods (`engine.control.engine.has_vime_worker_extension`), else vLLM's reload
    vime_worker_extension: bool = True

    @classmethod
    def of(cls, args) -> DriverSetup:
        """The setup of a slime-style `args` (the run's namespace, or a partial one: the rest defaults), as
        `Section.of` reads a section; `TrainingSession` builds it from its `RunConfig`'s sections instead."""
        from vime.engine.control.engine import has_vime_worker_extension

        return cls(WeightSyncConfig.of(args), MegatronConfig.of(args), EnginesConfig.of(args),
                   has_vime_worker_extension(args))


class TransportDriver:
    concurrent = False  # True: send and the engines' load join one collective, so both must run at once
    update_is_recovery_copy = False  # True: a prepared handle is what a restarted engine loads (`recovery_load_call`)

    def __init__(self, setup: DriverSetup = DriverSetup()):
        pass  # a transport that reads none of the run's settings

    def connect(self, engine_urls: list[str], trainer_address: Callable[[], tuple[str, int]]) -> None:
        """Before each `prepare`: the engines the update goes to, and a (host, free port) on training rank 0's
        node for transports that open a connection there."""

    def prepare(self, version: int) -> Any:
        """The handle of one update (plain data: it travels to the trainers and the rollout manager)."""
        raise NotImplementedError

    def load_calls(self, engine_urls: list[str], handle: Any) -> dict[str, tuple[str, dict[str, str]]]:
        """The rollout manager: {url: (worker method, string kwargs)} that loads the update; an engine left out
        loads nothing."""
        raise NotImplementedError

    def bound_engines(self, handle: Any) -> list[str] | None:
        """The engines a collective update was prepared for (others cannot join it); None: any engine."""
        return None

    def cleanup(self, handle: Any) -> None:
        """After every engine loaded: remove what `prepare` and `send` left."""


class WeightSender:
    sends_adapter = False  # True: the trainer writes its LoRA adapters into the handle instead (`Trainer.send_weights`)

    def send(self, weights: Weights, stage: int | None, handle: Any) -> None:
        """Every training rank, together: `weights` of the rank's pipeline stage; `stage` is that stage on the one
        rank per stage that writes it (data- and tensor-parallel rank 0), None on the others."""
        raise NotImplementedError

    def release(self) -> int:
        """Before the trainer offloads: drop what `send` keeps on the device for the engines; returns its bytes
        (nothing kept: 0)."""
        return 0


class WeightTransport(TransportDriver, WeightSender):
    """Both halves in one class, for a transport a plugin or a test registers as one (`TRANSPORTS[kind] = cls`):
    the driver and each rank still make an instance of their own (the driver's with its `DriverSetup`, a rank's
    with none)."""
