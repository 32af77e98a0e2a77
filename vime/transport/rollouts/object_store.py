"""Rollouts through Ray's object store: what vime did before it had transports, now as codec bytes."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from vime.data.sample_codec import decode_rollout, encode_rollout
from vime.transport.rollouts.base import RolloutTransport


@dataclass(frozen=True)
class ObjectStoreHandle:
    rollout_id: int
    ref: ray.ObjectRef  # inside a dataclass, so Ray passes it on as a reference instead of resolving it


class ObjectStoreTransport(RolloutTransport):
    """The handle holds an ObjectRef of the encoded rollout; it lives as long as the producer and the handle do."""

    def put(self, rollout_id, groups, extra):
        return ObjectStoreHandle(rollout_id, ray.put(encode_rollout(groups, extra)))

    def get(self, handle, vocab_size=None):
        return decode_rollout(ray.get(handle.ref), vocab_size)
