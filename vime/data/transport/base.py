"""The one interface every rollout transport implements."""

from __future__ import annotations

from typing import Any


class RolloutTransport:
    """put() in the producer, get() in a consumer; handles are small and cross process boundaries through Ray.

    Durable transports also remember rollouts across restarts: `stored()` lists what is held, `trim()` lets go
    of rollouts that no longer need replaying (trained into a checkpoint).
    """

    durable = False

    def put(self, rollout_id: int, groups: list[list[dict]], extra: dict[str, Any]) -> Any:
        """Store one rollout; returns its handle once the data is safe (durable for durable transports)."""
        raise NotImplementedError

    def get(self, handle) -> tuple[list[list[dict]], dict[str, Any]]:
        """(groups of sample dicts, extra) of a rollout put earlier, possibly by another process."""
        raise NotImplementedError

    def stored(self) -> dict[int, Any]:
        """Rollout id -> handle of every rollout still held (only durable transports hold any)."""
        return {}

    def trim(self, rollout_ids) -> None:
        """Let go of these rollouts (no-op where nothing outlives its handle)."""

    def close(self) -> None:
        pass
