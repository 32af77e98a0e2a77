"""Moving the trainer's weights into running engines, behind one small interface.

A transport has two halves: `send(trainer)` runs on every training rank (collectively) and `apply(engine_urls,
handle)` runs in the rollout manager while the engines are paused. `update_weights` drives one update:
pause -> send -> apply -> reset prefix cache -> bump weight version -> resume.

Implementations: `disk` (HF safetensors into a directory, /dev/shm when available; engines reload it).
"""

from __future__ import annotations

import time

from vime.backends.weight_transport.disk import DiskWeightTransport

TRANSPORTS = {"disk": DiskWeightTransport}


def get_transport(args):
    try:
        return TRANSPORTS[args.update_weight_transport](args)
    except KeyError:
        raise ValueError(f"--update-weight-transport {args.update_weight_transport!r}: choose one of "
                         f"{sorted(TRANSPORTS)}") from None


def update_weights(args, train_group, rollout_manager, version: int) -> dict[str, float]:
    """Push the current policy into every engine; returns timing metrics."""
    import ray

    transport = get_transport(args)
    start = time.perf_counter()
    ray.get(rollout_manager.pause.remote("wait"))  # in-flight requests finish first; none is lost
    paused = time.perf_counter()
    handle = transport.prepare(version)
    train_group.call("send_weights", transport, handle)
    sent = time.perf_counter()
    ray.get(rollout_manager.apply_weights.remote(transport, handle, version))
    done = time.perf_counter()
    transport.cleanup(handle)
    return {"perf/update_weights_time": done - start, "perf/update_weights_pause_time": paused - start,
            "perf/update_weights_send_time": sent - paused, "perf/update_weights_apply_time": done - sent}
