"""Engine health monitor (--use-fault-tolerance): a background thread of the rollout manager.

After --rollout-health-check-first-wait seconds, every --rollout-health-check-interval seconds it probes each
engine (its server process alive, `/health` answering within --rollout-health-check-timeout). An engine that
fails is handed to `restart(rank, reason)`, which the rollout manager implements: take it out of the router, kill
it, start a new one in the same placement bundle, give it the current weights and weight version, register it
again. Restarts run one at a time, in this thread; the rollout goes on with the other engines meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


class EngineHealthMonitor:
    def __init__(self, num_engines: int, probe: Callable[[int], str | None], restart: Callable[[int, str], None],
                 interval_s: float, first_wait_s: float = 0.0):
        """`probe(rank)` returns None when engine `rank` is healthy, else why not; `restart(rank, reason)`."""
        self.num_engines = num_engines
        self.probe = probe
        self.restart = restart
        self.interval_s = interval_s
        self.first_wait_s = first_wait_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vime-engine-health", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def check_soon(self, rank: int) -> None:
        """Probe the engines now instead of at the next interval (a control call to engine `rank` failed)."""
        self._wake.set()

    def check_once(self) -> list[int]:
        """Probe every engine once and restart the failed ones; returns the ranks restarted."""
        restarted = []
        for rank in range(self.num_engines):
            if self._stop.is_set():
                break
            try:
                reason = self.probe(rank)
            except Exception as e:  # a probe that fails is a failed engine, not a dead monitor
                reason = f"health probe raised {type(e).__name__}: {e}"
            if reason is None or self._stop.is_set():
                continue
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
