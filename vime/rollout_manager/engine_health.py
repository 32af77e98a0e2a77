"""Engine health monitor (--use-fault-tolerance): a background thread of the rollout manager.

After --rollout-health-check-first-wait seconds, every --rollout-health-check-interval seconds it probes each
engine (its server process alive, `/health` answering within --rollout-health-check-timeout). An engine that
fails is handed to `restart(rank, reason)`, which the rollout manager implements: take it out of the router, kill
it, start a new one in the same placement bundle, give it the current weights and weight version, register it
again. Restarts run one at a time, in this thread; the rollout goes on with the other engines meanwhile.
Given `probe_router` and `restart_router`, it probes the router first, and a dead router is started again (with
every engine in service registered) before the engines are probed. The engines are probed `PROBE_FANOUT` at a
time (a sweep of 1,000 engines takes about 1,000 / PROBE_FANOUT probe times, not 1,000), under `sweep_lock` when
given (the fleet's: no probe meets a weight update, during which an engine may answer /health late).

`FailedRollouts` judges each rollout by its failed samples (--max-failed-samples-ratio): one above the ratio is
not trained on, and --max-consecutive-failed-rollouts of them in a row stop the run.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

logger = logging.getLogger(__name__)

PROBE_FANOUT = 32  # engine probes in flight at once (each a thread and, for /health, a connection)


class EngineHealthMonitor:
    def __init__(self, num_engines: int, probe: Callable[[int], str | None], restart: Callable[[int, str], None],
                 interval_s: float, first_wait_s: float = 0.0,
                 probe_router: Callable[[], str | None] | None = None,
                 restart_router: Callable[[str], None] | None = None,
                 sweep_lock: contextlib.AbstractContextManager | None = None):
        """`probe(rank)` returns None when engine `rank` is healthy, else why not; `restart(rank, reason)`.
        `probe_router()` and `restart_router(reason)` likewise for the router (both or neither). `sweep_lock`:
        held while the engines are probed (not while they are restarted)."""
        if (probe_router is None) != (restart_router is None):
            raise ValueError("EngineHealthMonitor: pass both probe_router and restart_router, or neither")
        self.num_engines = num_engines
        self.probe = probe
        self.restart = restart
        self.probe_router = probe_router
        self.restart_router = restart_router
        self.interval_s = interval_s
        self.first_wait_s = first_wait_s
        self.sweep_lock = sweep_lock if sweep_lock is not None else contextlib.nullcontext()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # in the starter's context variables: a restart it makes is counted in the run's rollout context
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,),
                                        name="vime-engine-health", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def check_soon(self, rank: int | None = None) -> None:
        """Probe now instead of at the next interval (a control call to engine `rank` failed, or a rollout lost
        many samples)."""
        self._wake.set()

    def check_router(self) -> bool:
        """Probe the router once and restart it if it failed; returns whether it was restarted."""
        if self.probe_router is None or self._stop.is_set():
            return False
        try:
            reason = self.probe_router()
        except Exception as e:  # a probe that fails is a failed router, not a dead monitor
            reason = f"router health probe raised {type(e).__name__}: {e}"
        if reason is None or self._stop.is_set():
            return False
        logger.error("the router is unhealthy (%s): restarting it", reason)
        try:
            self.restart_router(reason)
            return True
        except Exception:
            if not self._stop.is_set():
                logger.exception("restarting the router failed; trying again at the next check")
            return False

    def _probe_one(self, rank: int) -> str | None:
        return None if self._stop.is_set() else self.probe(rank)  # `probe_each` turns a raise into a reason

    def probe_engines(self) -> dict[int, str]:
        """{rank: why} of the engines that failed their probe, `PROBE_FANOUT` probed at a time."""
        return probe_each(self.num_engines, self._probe_one, self.sweep_lock)

    def check_once(self) -> list[int]:
        """Probe the router, then every engine, once; restart the failed ones (one at a time); returns the engine
        ranks restarted. The router goes first: a restarted engine is registered with it."""
        self.check_router()
        restarted = []
        for rank, reason in self.probe_engines().items():
            if self._stop.is_set():
                break
            logger.error("engine %d is unhealthy (%s): restarting it", rank, reason)
            try:
                self.restart(rank, reason)
                restarted.append(rank)
            except Exception:
                if self._stop.is_set():
                    break
                logger.exception("restarting engine %d failed; trying again at the next check", rank)
        return restarted

    def _run(self) -> None:
        if self._stop.wait(self.first_wait_s):
            return
        while not self._stop.is_set():
            started = time.monotonic()
            self.check_once()
            self._wake.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
            self._wake.clear()


def probe_each(num_engines: int, probe: Callable[[int], str | None],
               lock: contextlib.AbstractContextManager | None = None) -> dict[int, str]:
    """{rank: why} of engines 0..num_engines-1 whose `probe(rank)` failed (returned a reason, or raised),
    `PROBE_FANOUT` at a time, under `lock` when given."""
    def one(rank: int) -> str | None:
        try:
            return probe(rank)
        except Exception as e:  # a probe that fails is a failed engine, not a dead monitor
            return f"health probe raised {type(e).__name__}: {e}"

    with lock or contextlib.nullcontext(), ThreadPoolExecutor(max(1, min(num_engines, PROBE_FANOUT)),
                                                              thread_name_prefix="vime-engine-probe") as pool:
        reasons = list(pool.map(one, range(num_engines)))
    return {rank: reason for rank, reason in enumerate(reasons) if reason is not None}


class FailedRollouts:
    """Which rollouts are trained on: one whose failed-sample ratio is above `max_ratio` is skipped (its gradient
    would come from the few samples that survived an outage, or from none); `max_consecutive` skipped in a row
    raise, as an outage that restarts did not fix. Judge every generated rollout once, in order."""

    def __init__(self, max_ratio: float, max_consecutive: int):
        self.max_ratio = max_ratio
        self.max_consecutive = max_consecutive
        self.in_a_row = 0

    def judge(self, rollout_id: int, failed: int, total: int) -> str | None:
        """None when rollout `rollout_id` is trained on, else why not; raises after too many skipped in a row."""
        ratio = failed / total if total else 1.0  # no samples at all: nothing to train on either
        if ratio <= self.max_ratio:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        reason = (f"rollout {rollout_id}: {failed} of {total} samples failed ({ratio:.0%}), above "
                  f"--max-failed-samples-ratio {self.max_ratio}")
        if self.in_a_row >= self.max_consecutive:
            raise RuntimeError(f"{reason}; {self.in_a_row} rollouts in a row failed (--max-consecutive-failed-"
                               f"rollouts {self.max_consecutive}): the engines or the router are not recovering. "
                               f"See the router and engine logs under <output-dir>/logs; raise the flag to wait "
                               f"longer")
        return reason
