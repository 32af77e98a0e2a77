"""The engine health monitor's loop, with fake probes: who gets restarted, when, and that failures never kill it."""

from __future__ import annotations

import threading
import time

from vime.ray.health import EngineHealthMonitor


def test_only_failed_engines_are_restarted_and_a_failed_restart_is_retried():
    health = {0: None, 1: "/health did not answer"}
    restarts, attempts = [], []

    def restart(rank, reason):
        attempts.append(rank)
        if len(attempts) == 1:
            raise RuntimeError("engine did not start")
        restarts.append((rank, reason))
        health[rank] = None

    monitor = EngineHealthMonitor(2, health.get, restart, interval_s=0.05)
    assert monitor.check_once() == []  # the restart failed: logged, not raised
    assert monitor.check_once() == [1] and restarts == [(1, "/health did not answer")]
    assert monitor.check_once() == []


def test_a_raising_probe_counts_as_unhealthy():
    def probe(rank):
        raise TimeoutError("actor stuck")

    seen = []
    EngineHealthMonitor(1, probe, lambda rank, reason: seen.append(reason), interval_s=1).check_once()
    assert seen == ["health probe raised TimeoutError: actor stuck"]


def test_thread_waits_first_then_checks_every_interval_and_stops():
    probes = []
    monitor = EngineHealthMonitor(1, lambda rank: probes.append(time.monotonic()), lambda r, why: None,
                                  interval_s=0.1, first_wait_s=0.3)
    start = time.monotonic()
    monitor.start()
    time.sleep(0.75)
    monitor.stop()
    n = len(probes)
    assert probes[0] - start >= 0.3 and 4 <= n <= 6
    time.sleep(0.3)
    assert len(probes) == n  # stopped


def test_check_soon_probes_before_the_interval():
    probed = threading.Event()
    calls = []

    def probe(rank):
        calls.append(rank)
        if len(calls) > 1:
            probed.set()

    monitor = EngineHealthMonitor(1, probe, lambda r, why: None, interval_s=60)
    monitor.start()
    time.sleep(0.2)
    monitor.check_soon(0)
    assert probed.wait(2), "a suspect engine was not probed at once"
    monitor.stop()
