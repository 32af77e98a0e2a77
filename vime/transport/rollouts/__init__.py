"""The data buffer's transports: how a rollout travels from the rollout manager to the trainer side.

    transport = make_transport(data_buffer)             # the run's DataBufferConfig
    handle = transport.put(rollout_id, groups, extra)   # rollout manager; groups of Sample dicts, JSON `extra`
    groups, extra = transport.get(handle)               # the training ranks, in other processes

The driver holds a `RolloutRef` (handle + the small JSON extra) and never decodes the samples.

`--rollout-data-transport object-store` (default) keeps rollouts in Ray's object store; `straw` writes them
durably to `--rollout-data-dir`, where they outlive a crash and are replayed on resume. Both carry the bytes
of `vime.data.sample_codec`, so nothing is unpickled from a stored rollout.
"""

from __future__ import annotations

from vime.config.rollout import DataBufferConfig
from vime.transport.rollouts.base import RolloutRef, RolloutTransport, rollout_summary


def make_transport(data_buffer: DataBufferConfig) -> RolloutTransport:
    """The transport --rollout-data-transport names (`data_buffer`), over --rollout-data-dir for straw."""
    kind = data_buffer.rollout_data_transport
    if kind == "object-store":
        from vime.transport.rollouts.object_store import ObjectStoreTransport

        return ObjectStoreTransport()
    if kind == "straw":
        from vime.transport.rollouts.straw_store import StrawTransport

        return StrawTransport(data_buffer.rollout_data_dir)
    raise ValueError(f"unknown --rollout-data-transport {kind!r}: use object-store or straw")


__all__ = ["RolloutRef", "RolloutTransport", "make_transport", "rollout_summary"]
