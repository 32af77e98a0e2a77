"""vime's vLLM general plugin (entry point `vllm.general_plugins: vime`, pyproject.toml).

vLLM runs general plugins in every process of an engine (API server, engine core, workers). The idle-spin cap
acts only in engines vime starts, which carry VIME_ENGINE_IDLE_SPIN_S in their environment (`engine.engine_env`,
CPU only; the switches' names: `vime.engine.protocol.names`).

Why: a vLLM worker busy-waits (sched_yield) for one second after every message from its engine core before it
sleeps on a socket (`shm_broadcast.SpinCondition`, busy_loop_s=1); on a GPU that keeps step dispatch quick. On a
machine of a few cores that second is a whole core taken from the trainer each time a rollout or a weight update
ends (measured here: 1.0 CPU-second per engine after every call, and a send of the weights 2.5x slower during it).
The cap keeps the spin between decode steps, which follow each other within milliseconds.

On every CPU engine it also mends vLLM's CPU rotary kernel for 3-D queries and keys (`cpu_rope`; DeepSeek's
multi-latent attention) and the rejection sampler's expansion of each request's temperature over its draft tokens
(`cpu_sampler.patch_spec_expand`; speculative decoding): a wrong result is not a matter of tuning; and it spares
the C++ compilation of the sampler's rank count at the first log-prob request (`cpu_sampler`: 2.5-14 s of every
engine start).
"""

from __future__ import annotations

import os

from vime.engine.protocol.names import CORE_FORK_ENV, IDLE_SPIN_ENV


def configure() -> None:
    """The entry point: cap the workers' idle spin when vime started this engine; capture routed experts when
    asked (`routing_capture`, CPU engines of --use-rollout-routing-replay)."""
    from vime.engine.in_vllm import routing_capture
    from vime.engine.in_vllm.cpu_rope import patch_cpu_rotary
    from vime.engine.in_vllm.cpu_sampler import patch_rank_count, patch_spec_expand

    patch_cpu_rotary()  # correctness fixes: on every CPU engine, whoever started it
    patch_spec_expand()
    patch_rank_count()
    if routing_capture.enabled():
        routing_capture.install()
    if os.environ.get(CORE_FORK_ENV) == "1":
        fork_engine_core()
    seconds = os.environ.get(IDLE_SPIN_ENV)
    if seconds is None:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: nothing to cap
        return
    cap_idle_spin(SpinCondition, float(seconds))


def cap_idle_spin(spin_condition_class, seconds: float) -> None:
    """Readers of `spin_condition_class` made from now on busy-wait at most `seconds` after a message."""
    original = spin_condition_class.__init__
    if getattr(original, "vime_idle_spin_s", None) is not None:  # plugins may load more than once per process
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "is_reader", False) and hasattr(self, "busy_loop_s"):
            self.busy_loop_s = min(self.busy_loop_s, seconds)

    __init__.vime_idle_spin_s = seconds
    spin_condition_class.__init__ = __init__


def fork_engine_core() -> None:
    """Start the engine core process by fork from the API server, as vLLM does on a GPU, instead of the spawn
    vLLM's CPU platform forces for every process it starts: the spawned core imports vLLM over again (about 8 s
    of a core, most of an engine's start here). Only for the engines vime starts with one worker, run inside
    the core (`engine.single_worker_env`): the spawn is kept for worker processes, whose OpenMP binding wants a
    fresh process; the API server runs no OpenMP region before the fork, so the core starts its team afresh."""
    import multiprocessing

    try:
        from vllm.v1.engine import utils as engine_utils
    except ImportError:  # another vLLM layout: keep its start method
        return
    if getattr(engine_utils.get_mp_context, "vime_fork", False):
        return

    def get_mp_context():
        return multiprocessing.get_context("fork")

    get_mp_context.vime_fork = True
    engine_utils.get_mp_context = get_mp_context
