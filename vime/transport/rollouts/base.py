"""The one interface every rollout transport implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vime.data.weight_versions import trained_tokens_by_version


@dataclass(frozen=True)
class RolloutRef:
    """A produced rollout as the driver sees it: its transport handle and its small JSON `extra` (rollout id,
    metrics, data-source state, sample ids, trained tokens per weight version). The samples themselves are read by
    the training ranks, `transport.get(handle)`; the driver never decodes them."""

    handle: Any
    extra: dict[str, Any]

    @property
    def rollout_id(self) -> int:
        return self.extra["rollout_id"]


def rollout_summary(groups: list[list[dict]]) -> dict[str, list]:
    """What the driver keeps of a rollout's samples: their ids (the trained-samples record) and how many of each
    one's trained tokens each weight version sampled (async staleness, `vime.data.weight_versions`)."""
    samples = [s for g in groups for s in g]
    return {"sample_ids": [s["index"] for s in samples],
            "version_tokens": [trained_tokens_by_version(s) for s in samples]}


class RolloutTransport:
    """put() in the producer, get() in a consumer; handles are small and cross process boundaries through Ray.

    Durable transports also remember rollouts across restarts: `stored()` lists what is held, `trim()` lets go
    of rollouts that no longer need replaying (trained into a checkpoint).
    """

    durable = False

    def put(self, rollout_id: int, groups: list[list[dict]], extra: dict[str, Any]) -> Any:
        """Store one rollout; returns its handle once the data is safe (durable for durable transports)."""
        raise NotImplementedError

    def get(self, handle, vocab_size: int | None = None) -> tuple[list[list[dict]], dict[str, Any]]:
        """(groups of sample dicts, extra) of a rollout put earlier, possibly by another process. The samples are
        checked as they are decoded (`vime.data.sample_codec`), token ids against `vocab_size` when the reader
        knows it (a training rank passes its model's)."""
        raise NotImplementedError

    def stored(self) -> dict[int, Any]:
        """Rollout id -> handle of every rollout still held (only durable transports hold any)."""
        return {}

    def trim(self, rollout_ids) -> None:
        """Let go of these rollouts (no-op where nothing outlives its handle)."""

    def close(self) -> None:
        pass
