"""The engine health monitor's loop, with fake probes: who gets restarted (engines, the router), when, and that
failures never kill it; which rollouts are trained on (`FailedRollouts`)."""

from __future__ import annotations

import threading
import time

import pytest

from vime.rollout_manager.engine_health import EngineHealthMonitor, FailedRollouts


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


def test_a_dead_router_is_restarted_before_the_engines_are_probed():
    order, router_health = [], ["its process exited"]

    def restart_router(reason):
        order.append(("restart router", reason))
        router_health[0] = None

    def probe(rank):
        order.append(("probe engine", rank))

    monitor = EngineHealthMonitor(1, probe, lambda r, why: None, interval_s=1,
                                  probe_router=lambda: router_health[0], restart_router=restart_router)
    monitor.check_once()
    assert order == [("restart router", "its process exited"), ("probe engine", 0)]
    order.clear()
    monitor.check_once()  # healthy again: probed, not restarted
    assert order == [("probe engine", 0)]


def test_a_failed_router_restart_is_retried_and_a_raising_router_probe_counts_as_unhealthy():
    reasons = []

    def probe_router():
        raise ConnectionRefusedError("router port closed")

    def restart_router(reason):
        reasons.append(reason)
        if len(reasons) == 1:
            raise RuntimeError("vllm-router did not start")

    monitor = EngineHealthMonitor(1, lambda rank: None, lambda r, why: None, interval_s=1,
                                  probe_router=probe_router, restart_router=restart_router)
    assert monitor.check_router() is False  # the restart failed: logged, not raised
    assert monitor.check_router() is True
    assert reasons == ["router health probe raised ConnectionRefusedError: router port closed"] * 2


def test_router_probe_needs_its_restart():
    with pytest.raises(ValueError, match="probe_router and restart_router"):
        EngineHealthMonitor(1, lambda rank: None, lambda r, why: None, interval_s=1, probe_router=lambda: None)


def test_a_collective_update_leaves_out_the_engines_that_fail_their_probe_now(monkeypatch, tmp_path):
    """Every member of a broadcast group takes part in each broadcast: an engine that died since the last sweep
    (its node lost between two updates) is probed out before the group is formed and restarted soon; without
    fault tolerance the run stops there, naming it."""
    from types import SimpleNamespace

    from vime.engine.control.client import EngineControlError
    from vime.rollout_manager import engine_fleet, fleet_recovery
    from vime.rollout.context import RolloutContext

    router = []
    monkeypatch.setattr(fleet_recovery, "post_worker", lambda token, url, verb, worker: router.append((verb, worker)))
    fleet = engine_fleet.EngineFleet(SimpleNamespace(control_token_file=None, debug_train_only=False), None,
                                     tmp_path, RolloutContext())
    fleet.engines = [object()] * 3
    fleet.engine_urls = ["http://e0", "http://e1", "http://e2"]
    fleet.rank_urls = list(fleet.engine_urls)
    health = {0: None, 1: None, 2: None}
    monkeypatch.setattr(fleet.recovery, "probe_engine", health.get)
    assert fleet.recovery.live_engine_urls() == fleet.engine_urls  # all alive
    health[1] = "engine actor unreachable: ActorDiedError"
    with pytest.raises(EngineControlError, match=r"engine 1 \(http://e1\) failed its probe: engine actor "
                                                 r"unreachable.*--use-fault-tolerance"):
        fleet.recovery.live_engine_urls()  # without fault tolerance
    assert router == [] and len(fleet.engine_urls) == 3
    fleet.recovery.monitor = EngineHealthMonitor(3, health.get, lambda *a: None, interval_s=60)
    soon = []
    monkeypatch.setattr(fleet.recovery.monitor, "check_soon", lambda rank=None: soon.append(rank))
    assert fleet.recovery.live_engine_urls() == ["http://e0", "http://e2"]
    assert router == [("remove_worker", "http://e1")] and soon == [None]
    assert fleet.recovery.live_engine_urls() == ["http://e0", "http://e2"] and len(router) == 1  # out already


def test_rollouts_with_too_many_failed_samples_are_skipped():
    guard = FailedRollouts(max_ratio=0.5, max_consecutive=3)
    assert guard.judge(0, failed=128, total=256) is None  # at the ratio: trained on
    reason = guard.judge(1, failed=129, total=256)
    assert "rollout 1: 129 of 256 samples failed" in reason and "--max-failed-samples-ratio 0.5" in reason
    assert guard.judge(2, failed=0, total=0) is not None  # nothing came back: nothing to train on


def test_consecutive_failed_rollouts_stop_the_run_and_a_good_one_resets_the_count():
    guard = FailedRollouts(max_ratio=0.5, max_consecutive=3)
    assert guard.judge(0, 256, 256) and guard.judge(1, 256, 256)
    assert guard.judge(2, 0, 256) is None  # the outage ended: the count starts again
    assert guard.judge(3, 200, 256) and guard.judge(4, 200, 256)
    with pytest.raises(RuntimeError, match="3 rollouts in a row failed \\(--max-consecutive-failed-rollouts 3\\)"):
        guard.judge(5, 200, 256)


def test_failed_rollout_flags_are_checked(tiny_qwen3, arithmetic_data, capsys):
    from vime.arguments import parse_args

    base = ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type", "math"]
    args = parse_args(base)
    assert (args.max_failed_samples_ratio, args.max_consecutive_failed_rollouts) == (0.5, 3)
    for flag, value, message in (("--max-failed-samples-ratio", "1.5", "must be in [0, 1], got 1.5"),
                                 ("--max-consecutive-failed-rollouts", "0", "must be >= 1, got 0")):
        with pytest.raises(SystemExit):
            parse_args(base + [flag, value])
        assert f"{flag} {message}" in capsys.readouterr().err


def test_the_session_does_not_train_on_a_skipped_rollout_and_lets_it_go():
    from types import SimpleNamespace

    from vime.config.train import MegatronConfig
    from vime.transport.rollouts import RolloutRef
    from vime.driver.session import TrainingSession

    class Trainers:
        def train(self, rollout_id, handle):
            raise AssertionError(f"rollout {rollout_id} was trained on")

    trimmed = []
    session = TrainingSession.__new__(TrainingSession)  # no Ray, no actors: only what train() reads
    session.args, session.trainers, session.critic = SimpleNamespace(save=None), Trainers(), None
    session.config = SimpleNamespace(megatron=MegatronConfig(save=None))  # the section train() reads: no --save
    session.transport = SimpleNamespace(trim=trimmed.extend)
    session.data_state_after = {7: {"epoch": 0}}
    skipped = RolloutRef("handle", {"rollout_id": 7, "skip_reason": "rollout 7: 256 of 256 samples failed"})
    assert session.train(skipped) == {"train/skipped_rollout": 1.0}
    assert trimmed == [7] and session.data_state_after == {}
    with pytest.raises(AssertionError, match="rollout 8 was trained on"):  # no skip_reason: trained
        session.train(RolloutRef("handle", {"rollout_id": 8}))


@pytest.mark.parametrize("stuck", [False, True])
def test_the_sessions_exit_leaves_nothing_on_the_cluster(monkeypatch, stuck):
    """A cluster can outlive the run (--ray-address, or a process that runs several): the exit kills the rollout
    manager (asked to shut down first, unless a rollout left it stuck) and the engines made for it, shuts the
    trainers down and gives the placement group back. Before, a second run in one process hung for devices."""
    from types import SimpleNamespace

    from vime.driver import session as session_module
    from vime.driver.session import TrainingSession

    killed, calls = [], []
    monkeypatch.setattr(session_module.ray, "kill", killed.append)
    monkeypatch.setattr(session_module.ray, "get", lambda ref, timeout=None: calls.append(ref))
    manager = SimpleNamespace(shutdown=SimpleNamespace(remote=lambda: "manager shutdown"))
    session = TrainingSession.__new__(TrainingSession)  # no Ray: only what __exit__ reads
    session.metrics, session.critic = None, None
    session.manager, session.manager_stuck, session.engines = manager, stuck, ["engine 0", "engine 1"]
    session.trainers = SimpleNamespace(shutdown=lambda: calls.append("trainers"))
    session.placement = SimpleNamespace(release=lambda: calls.append("placement"))
    session.transport = SimpleNamespace(close=lambda: calls.append("transport"))
    session.run_lock = SimpleNamespace(__exit__=lambda: calls.append("lock"))
    session.__exit__(None, None, None)
    assert killed == [manager, "engine 0", "engine 1"]
    assert calls == ([] if stuck else ["manager shutdown"]) + ["trainers", "placement", "transport", "lock"]


def test_external_engines_that_never_answer_are_named(tmp_path):
    """The run waits for servers the user started (they may still be loading) up to --engine-startup-timeout,
    then names the ones that never answered /health."""
    import socket
    import time
    from types import SimpleNamespace

    from vime.rollout_manager.engine_fleet import EngineFleet
    from vime.rollout.context import RolloutContext

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        silent = f"127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends: nothing answers there
    args = SimpleNamespace(control_token_file=None, debug_train_only=False, engine_startup_timeout=1.0,
                           rollout_external_engine_addrs=[silent])
    fleet = EngineFleet(args, None, tmp_path, RolloutContext())
    fleet.engine_urls = [f"http://{silent}"]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"http://{silent} did not answer /health within --engine-startup-timeout"):
        fleet._wait_for_external_engines()
    assert time.monotonic() - start < 5
