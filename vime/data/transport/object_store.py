"""Rollouts through Ray's object store: what vime did before it had transports, now as codec bytes."""

from __future__ import annotations

import ray

from vime.data.sample_codec import decode_rollout, encode_rollout
from vime.data.transport.base import RolloutTransport


class ObjectStoreTransport(RolloutTransport):
    """The handle is an ObjectRef of the encoded rollout; it lives as long as the producer and the handle do."""

    def put(self, rollout_id, groups, extra):
        return ray.put(encode_rollout(groups, extra))

    def get(self, handle):
        return decode_rollout(ray.get(handle))
