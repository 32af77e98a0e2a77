"""What every weight transport is: the trainer's weights into running engines, in three places.

- The driver's instance (one for the run, `vime.ray.weight_sync.WeightSync`): `connect` to the engines, `prepare`
  the handle of one update, `cleanup` what it left.
- The rollout manager's copy (sent with each update): `load_calls` names the worker method each engine runs to load
  the update, `bound_engines` the engine set a collective update was made for.
- Each training rank's instance (one for the run, held by its actor): `send` gets the rank's weights and whether it
  writes; the transport never reaches into the trainer or Megatron's parallel state. State that must outlive an
  update (a process group, what the engines already hold, memory engines map) lives on that instance.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

Weights = list[tuple[str, torch.Tensor]]  # (HF name, tensor) of one pipeline stage, gathered over tensor parallel

BYTE_CHUNK = 16 * 2**20


def tensor_bytes(tensor: torch.Tensor, chunk: int = BYTE_CHUNK) -> Iterator[memoryview]:
    """A tensor's bytes (C order) as memoryviews of at most `chunk` bytes, copied through a buffer of this
    function's own; each view is valid until the next one. Never `tensor.numpy()`: numpy pins a CPU tensor's storage
    at its size for good, and --offload-train must later shrink the trainer's storages to zero."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    if flat.numel() == 0:
        return
    scratch = torch.empty(min(chunk, flat.numel()), dtype=torch.uint8)
    view = memoryview(scratch.numpy())
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        scratch[:n].copy_(flat[start:start + n])
        yield view[:n]


class WeightTransport:
    concurrent = False  # True: send and the engines' load join one collective, so both must run at once
    update_is_recovery_copy = False  # True: a prepared handle is what a restarted engine loads (`recovery_load_call`)

    def __init__(self, args):
        self.args = args

    def connect(self, engine_urls: list[str], trainer_address: Callable[[], tuple[str, int]]) -> None:
        """Driver, before each `prepare`: the engines the update goes to, and a (host, free port) on training
        rank 0's node for transports that open a connection there."""

    def prepare(self, version: int) -> Any:
        """Driver: the handle of one update (plain data: it travels to the trainers and the rollout manager)."""
        raise NotImplementedError

    def send(self, weights: Weights, stage: int | None, handle: Any) -> None:
        """Every training rank, together: `weights` of the rank's pipeline stage; `stage` is that stage on the one
        rank per stage that writes it (data- and tensor-parallel rank 0), None on the others."""
        raise NotImplementedError

    def load_calls(self, engine_urls: list[str], handle: Any) -> dict[str, tuple[str, dict[str, str]]]:
        """{url: (worker method, string kwargs)} that loads the update; an engine left out loads nothing."""
        raise NotImplementedError

    def bound_engines(self, handle: Any) -> list[str] | None:
        """The engines a collective update was prepared for (others cannot join it); None: any engine."""
        return None

    def release(self) -> int:
        """A training rank, before the trainer offloads: drop what `send` keeps on the device for the engines;
        returns its bytes (nothing kept: 0)."""
        return 0

    def cleanup(self, handle: Any) -> None:
        """Driver, after every engine loaded: remove what `prepare` and `send` left."""
