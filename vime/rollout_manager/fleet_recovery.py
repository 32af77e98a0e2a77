"""The engine fleet's fault tolerance (--use-fault-tolerance): what the health monitor's thread and failed control
calls do. A dead or hung engine is taken out of service and restarted in its bundle with the current weights (the
recovery copy, `recovery_weights`, that every weight update leaves); a dead router is restarted on a new loopback
port with the engines in service registered; workers someone else added to vime's router are removed. Without the
flag a failed control call raises.

`FleetRecovery` is a part of `EngineFleet` (`fleet.recovery`), made with it and given the fleet: it works through
the fleet's public state (the engines and their URLs, the router, the sleep state, the served version and `lock`,
which orders all of them) and its three ways to replace a part (`new_engine`, `start_own_router`, `match_sleep`),
and keeps its own: the health monitor, the recovery copy of the weights, the restarts deferred or in progress. The
fleet asks it to `settle` failed control calls, to restart what died once its engines wake (`after_wake_up`) and
to `stop`.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import ray

from vime.config.rollout import EnginesConfig, FaultToleranceConfig
from vime.engine.control import client
from vime.engine.control.engine import has_vime_worker_extension, http_ok
from vime.engine.control.router import post_worker, post_workers, router_ok
from vime.rollout.metrics import add_counter
from vime.rollout_manager.engine_health import EngineHealthMonitor, probe_each
from vime.utils.misc import find_free_port

logger = logging.getLogger(__name__)


class FleetRecovery:
    """What keeps an `EngineFleet`'s engines and router serving (see the module docstring)."""

    def __init__(self, fleet):
        self.fleet = fleet
        self.faults = FaultToleranceConfig.of(fleet.args)
        self.monitor: EngineHealthMonitor | None = None  # with --use-fault-tolerance, once the fleet serves
        self.recovery_weights: str | None = None  # HF directory of the current weights, for restarted engines
        self.deferred: set[int] = set()  # dead engines whose restart waits for the engines to wake
        self.starting: dict[int, object] = {}  # rank -> engine actor being started by a restart

    def health_monitor(self) -> EngineHealthMonitor:
        """The monitor of the fleet's engines and, when it is ours, the router (not started). Its sweeps hold the
        fleet's lock: never while weights are being loaded (a busy engine may answer /health late)."""
        own_router = self.fleet.router is not None  # an external router is not ours to restart
        return EngineHealthMonitor(len(self.fleet.engines), self.probe_engine, self.restart_engine,
                                   self.faults.rollout_health_check_interval,
                                   self.faults.rollout_health_check_first_wait,
                                   probe_router=self.probe_router if own_router else None,
                                   restart_router=self.restart_router if own_router else None,
                                   sweep_lock=self.fleet.lock)

    def start_monitor(self) -> None:
        """--use-fault-tolerance: watch the engines (and our router) from now on."""
        self.monitor = self.health_monitor()
        self.monitor.start()

    def stop(self) -> None:
        """The fleet shuts down: the monitor stops, an engine a restart is starting is killed (it must not outlive
        the fleet), and the recovery copy vime wrote is deleted."""
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        for actor in list(self.starting.values()):
            ray.kill(actor)
        self._drop_recovery_weights()

    def after_wake_up(self) -> None:
        """The engines are awake: the restarts deferred while they slept run now."""
        if self.deferred and self.monitor is not None:
            self.monitor.check_soon()

    def settle(self, errors: dict[str, str]) -> None:
        """The engines whose control call failed ({url: error}): without fault tolerance that is an error; with it,
        the dead ones are taken out of service (the monitor restarts them) and a healthy one's failure raises."""
        if not errors:
            return
        if self.monitor is None:
            raise client.EngineControlError("; ".join(errors.values()))
        self._take_out_dead(errors)

    def _take_out_dead(self, errors: dict[str, str]) -> None:
        """Of the engines whose control call failed, take the dead ones out of service; raise if one is healthy."""
        healthy_errors = []
        for url, error in errors.items():
            rank = self.fleet.rank_urls.index(url)
            reason = self.probe_engine(rank)
            if reason is None:
                healthy_errors.append(error)
                continue
            logger.error("engine %d (%s) failed a control call and its health check (%s); taken out of service "
                         "until it is restarted", rank, url, reason)
            self._take_out_of_service(url)
            self.monitor.check_soon(rank)
        if healthy_errors:
            raise client.EngineControlError("; ".join(healthy_errors))

    def live_engine_urls(self) -> list[str]:
        """The engines in service, after a probe of each. For a collective update (broadcast): every member takes
        part in each of its broadcasts, so one engine that died since the last health sweep (with its node, say)
        would fail the whole update. With --use-fault-tolerance the dead are taken out (the monitor restarts
        them); without it the run stops here, naming them."""
        fleet = self.fleet
        failed = probe_each(len(fleet.engines), self.probe_engine, fleet.lock)
        dead = {rank: why for rank, why in failed.items() if fleet.rank_urls[rank] in fleet.engine_urls}
        if dead and self.monitor is None:
            raise client.EngineControlError(
                "before a weight update, " + "; ".join(f"engine {r} ({fleet.rank_urls[r]}) failed its probe: {why}"
                                                       for r, why in dead.items())
                + ". Without --use-fault-tolerance a dead engine stops the run")
        for rank, why in dead.items():
            logger.error("engine %d (%s) failed its probe before a weight update (%s); taken out of service until "
                         "it is restarted", rank, fleet.rank_urls[rank], why)
            self._take_out_of_service(fleet.rank_urls[rank])
        if dead:
            self.monitor.check_soon()
        return list(fleet.engine_urls)

    def _take_out_of_service(self, url: str) -> None:
        with self.fleet.lock:
            if url in self.fleet.engine_urls:
                self.fleet.engine_urls.remove(url)
        try:
            post_worker(self.fleet.token, self.fleet.router_url, "remove_worker", url)
        except OSError as e:  # already removed
            logger.info("router: remove_worker %s: %s", url, e)

    def probe_engine(self, rank: int) -> str | None:
        """None when engine `rank` is healthy, else why not."""
        timeout = self.faults.rollout_health_check_timeout
        try:
            if not ray.get(self.fleet.engines[rank].is_alive.remote(), timeout=timeout):
                return "its server process exited"
        except Exception as e:  # the actor died, or is stuck
            return f"engine actor unreachable: {type(e).__name__}"
        if not http_ok(self.fleet.rank_urls[rank] + "/health", timeout=timeout):
            return f"/health did not answer within --rollout-health-check-timeout {timeout}s"
        return None

    def reconcile_router(self) -> list[str]:
        """Make vime's router serve exactly the engines in service: a worker someone else added (its routes that
        change workers answer anyone on the node) is removed and reported, an engine of ours it lost is added
        back. Returns the workers removed. An external router (--vllm-router-ip) is not ours to prune."""
        fleet = self.fleet
        if fleet.router is None or fleet.router_url is None:
            return []
        with fleet.lock:  # the engine set does not change meanwhile (restarts register under it)
            served, ours = set(fleet.router.workers()), set(fleet.engine_urls)
            strangers = sorted(served - ours)
            post_workers(fleet.token, fleet.router_url, "remove_worker", strangers)
            post_workers(fleet.token, fleet.router_url, "add_worker", sorted(ours - served))
        if strangers:
            add_counter("rollout/router_unknown_workers_removed", len(strangers))
            logger.error("the router served workers vime did not start, removed: %s (someone on this node added them "
                         "through the router's /add_worker; samples they answered since the last check may be "
                         "forged)", strangers)
        return strangers

    def probe_router(self) -> str | None:
        """None when vime's router is healthy, else why not."""
        timeout = self.faults.rollout_health_check_timeout
        if self.fleet.router.proc is None or self.fleet.router.proc.poll() is not None:
            return "its process exited"
        if not router_ok(self.fleet.token, self.fleet.router_url, timeout=timeout):
            return f"/health did not answer within --rollout-health-check-timeout {timeout}s"
        return None

    def restart_router(self, reason: str) -> None:
        """Kill the router and start a new one on a new loopback port with every engine in service; rollouts pick
        up its URL from the rollout context. Requests still retrying at the old URL fail (their samples count
        against --max-failed-samples-ratio)."""
        start = time.perf_counter()
        old_url = self.fleet.router_url
        with self.fleet.lock:  # the engine set and the URL it is registered at change together
            self.fleet.router.stop()
            self.fleet.start_own_router(find_free_port())
        add_counter("rollout/router_restarts")
        logger.warning("router restarted in %.1fs (%s): %s -> %s with engines %s", time.perf_counter() - start,
                       reason, old_url, self.fleet.router_url, self.fleet.engine_urls)

    def check_soon(self) -> None:
        """Probe the router and the engines now (a rollout lost many samples); no-op without fault tolerance."""
        if self.monitor is not None:
            self.monitor.check_soon()

    def restart_engine(self, rank: int, reason: str) -> None:
        """Take engine `rank` out, kill it, start a new one in its bundle, load the current weights, register it.
        While the engines sleep (--offload-rollout) the trainer uses the devices a new engine would take in full to
        start: the dead one only leaves service, and the restart waits for the wake-up (`after_wake_up`)."""
        fleet = self.fleet
        start = time.perf_counter()
        old_url = fleet.rank_urls[rank]
        self._take_out_of_service(old_url)
        with fleet.lock:
            if fleet.asleep:
                if rank not in self.deferred:
                    logger.warning("engine %d: restart deferred until the engines wake up", rank)
                self.deferred.add(rank)
                return
            self.deferred.discard(rank)
        old = fleet.engines[rank]
        try:
            ray.get(old.stop.remote(), timeout=30)  # kills the server's whole process tree
        except Exception as e:
            logger.warning("engine %d: stop failed (%s); killing its actor", rank, type(e).__name__)
        ray.kill(old, no_restart=True)  # its watchdog then kills whatever is left of the server
        new = fleet.new_engine(rank)
        self.starting[rank] = new
        try:
            url = ray.get(new.start.remote(), timeout=EnginesConfig.of(fleet.args).engine_startup_timeout + 60)
            with fleet.lock:  # no weight update in between: the engine joins with the current weights
                if fleet.served_version is not None:  # weights were pushed since the start: load the latest
                    call = recovery_load_call(fleet.args, self.recovery_weights) if self.recovery_weights else None
                    client.update_weights_all(fleet.token, [url], {url: call}, fleet.served_version)
                fleet.match_sleep(url)  # the fleet fell asleep while it started
                fleet.engines[rank] = new
                fleet.rank_urls[rank] = url
                fleet.engine_urls.append(url)
                post_worker(fleet.token, fleet.router_url, "add_worker", url)
        except BaseException:
            ray.kill(new)
            raise
        finally:
            self.starting.pop(rank, None)
        add_counter("rollout/engine_restarts")
        logger.warning("engine %d restarted in %.1fs (%s): %s -> %s, weight version %s", rank,
                       time.perf_counter() - start, reason, old_url, url,
                       "initial" if fleet.served_version is None else fleet.served_version)

    def engine_restarts(self) -> int:
        return int(self.fleet.context.counters.get("rollout/engine_restarts", 0))

    def router_restarts(self) -> int:
        return int(self.fleet.context.counters.get("rollout/router_restarts", 0))

    def set_recovery_weights(self, path: str) -> None:
        """Remember `path` (the engines' current weights: HF safetensors, or a LoRA run's adapter) for restarts;
        drops the previous one."""
        with self.fleet.lock:
            if path != self.recovery_weights:
                self._drop_recovery_weights()
            self.recovery_weights = path

    def _drop_recovery_weights(self) -> None:
        """Delete the recovery directory if vime wrote it (a weight-update directory), never a user's."""
        path = self.recovery_weights
        if path and Path(path).name.startswith(("vime_weights_", "vime_recovery_", "vime_lora_")):
            shutil.rmtree(path, ignore_errors=True)
        self.recovery_weights = None


def recovery_load_call(args, weights_dir: str):
    """The call that makes a restarted engine load the recovery weights: a LoRA adapter (`lora_adapter`
    transport) on the base it starts with, else HF safetensors (the disk transport's; imported here, not at the
    top, so that starting the fleet does not wait for torch)."""
    from vime.transport.weights.lora_adapter.driver import adapter_dirs, adapter_load_call

    adapters = adapter_dirs(weights_dir)
    if adapters:
        return adapter_load_call(adapters)
    from vime.transport.weights.disk.driver import load_call

    return load_call(weights_dir, has_vime_worker_extension(args))
