"""The engine fleet: the one owner of the vLLM engines, the router in front of them, their health, restarts,
sleep and wake-up, and the weights they serve.

Lives in the rollout manager's process (`RolloutManager.fleet`), where the rollouts run, and keeps that
process's rollout context (`vime.rollout.context`) up to date: the router's URL and the engines in service.
With --use-fault-tolerance its `recovery` (`FleetRecovery`, fleet_recovery.py) runs an `EngineHealthMonitor` thread
that restarts dead or hung engines and a dead router (a new one on a new loopback port, the engines in service
registered); control calls skip an engine found dead, which the monitor restarts with the current weights (the
recovery copy, an HF directory the weight sync leaves with every update).

It sends the run's control token (`vime.utils.auth.RunToken`, which its engines require on their routes) from the
rollout context it was given, where the rollout manager put it (`run_control_token`: made, or read from
--control-token-file): rollouts, the fleet and its engines carry the same one. The router listens on this node's
loopback only and admits only callers with the serving key (`router_door`); it holds that key, which opens the
engines' generation routes and none of their control routes.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import ray

from vime.config.rollout import EnginesConfig, FaultToleranceConfig
from vime.config.router import RouterConfig
from vime.config.run import DebugConfig, JobConfig
from vime.engine.control import client
from vime.engine.control.arguments import engine_dtype_warning, router_args_from
from vime.engine.control.engine import VLLMEngine, http_ok
from vime.engine.control.router import Router, post_workers
from vime.engine.control.router_gate import RouterGate
from vime.engine.control.speculative import speculative_config
from vime.rollout.context import RolloutContext
from vime.rollout_manager.fleet_recovery import FleetRecovery, recovery_load_call
from vime.utils.auth import RunToken
from vime.utils.deadline import control, gather
from vime.utils.misc import find_free_port
from vime.utils.process import wait_until

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")  # what vLLM's sleep frees and /wake_up?tags= brings back, in wake-up order


def run_control_token(args) -> RunToken:
    """The run's control token: --control-token-file's, else a new one. Its maker hands it on (the driver to its
    engines and the rollout manager, which puts it in its rollout context)."""
    job = JobConfig.of(args)
    return RunToken.read(job.control_token_file) if job.control_token_file else RunToken.new()


JUDGE_RANKS = 1000  # the judge's engine i is engine 1000 + i in logs (engine_1000.log)


def new_engine(args, placement, rank: int, log_dir: Path, token: RunToken, role: str = "engine"):
    """An engine actor for `role` ("engine", or "judge": --judge-checkpoint's) rank `rank` in its placement
    bundle, not started (`VLLMEngine.start`)."""
    options, share, gpus = {"num_cpus": 1}, None, None
    if placement is not None and placement.pg is not None:
        options = placement.actor_options(placement.bundle_of(role, rank))
        share = placement.cpu_share(role, rank)
        # all of its tensor-parallel bundles' GPUs
        gpus = placement.engine_gpus(rank) if role == "engine" else placement.judge_gpus(rank)
    engine_rank = rank if role == "engine" else JUDGE_RANKS + rank
    return ray.remote(VLLMEngine).options(**options).remote(args, engine_rank, str(log_dir), token, share, gpus)


def new_engines(args, placement, log_dir: Path, token: RunToken) -> list:
    """vime's engine actors for a run (none with external engines). Made by the run's driver, their processes
    boot beside the rollout manager's instead of after it (about 3 s of every run's start-up); that manager's
    fleet runs them from then on (`EngineFleet(engines=...)`), while Ray counts the driver as their owner: they
    die with it, not with the manager (`TrainingSession.__exit__` kills them with a stuck manager)."""
    engines = EnginesConfig.of(args)
    debug = DebugConfig.of(args)
    if engines.rollout_external_engine_addrs or debug.debug_train_only:
        return []
    return [new_engine(args, placement, rank, log_dir, token) for rank in range(engines.num_engines())]


class EngineFleet:
    """The engines and the router in front of them, for one run (see the module docstring); what keeps them
    serving under --use-fault-tolerance is its `recovery`'s (`FleetRecovery`), which works through the state and
    the methods here that have no leading underscore."""

    def __init__(self, args, placement, log_dir: Path, context: RolloutContext, engines: list | None = None):
        debug = DebugConfig.of(args)
        self.args = args
        self.placement = placement
        self.log_dir = log_dir
        # the router URL and the engines in service, as rollouts read them, and the run's token
        self.context = context
        self.engines: list = []
        self.router: Router | None = None
        self.rank_urls: list[str] = []  # engine rank -> its current URL (in service or being restarted)
        self.served_version: int | None = None  # the version last sent to the engines, if any
        self.lock = threading.RLock()  # engine set changes vs. control calls and weight updates
        self._launched: list = []  # the engines' start calls in flight (`launch`)
        self.speculative = speculative_config(args) is not None  # the engines draft (--vllm-speculative-config)
        self.asleep: set[str] = set()  # which of SLEEP_TAGS the engines hold in host memory or not at all (`sleep`)
        # the router's front for custom functions (`plugin_router_url`), bound now: its address is fixed for the run
        self.gate = None if debug.debug_train_only else RouterGate(lambda: self.context.router_url,
                                                                    self.token.serving_headers)
        self._given = list(engines or [])  # engine actors made for this fleet, not started yet
        self.recovery = FleetRecovery(self)  # restarts what dies (--use-fault-tolerance), the recovery weights

    @property
    def token(self) -> RunToken:
        """The run's: what control calls, the router and the engines it starts carry (its context's, so that
        rollouts send the same one)."""
        return self.context.token

    @property
    def engine_urls(self) -> list[str]:
        """The engines in service (the rollout context's list: rollouts abort on these)."""
        return self.context.engine_urls

    @engine_urls.setter
    def engine_urls(self, urls: list[str]) -> None:
        self.context.engine_urls = list(urls)

    @property
    def router_url(self) -> str | None:
        return self.context.router_url

    @router_url.setter
    def router_url(self, url: str) -> None:
        self.context.router_url = url

    def plugin_router_url(self) -> str | None:
        """The router's address custom functions get (`vime.utils.plugin_args`): the fleet's gate in front of the
        router in service, which adds the serving key for this user's processes and stays where it is when the
        router restarts (`router_gate`); None without engines."""
        return None if self.gate is None else self.gate.url

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def launch(self) -> None:
        """Begin starting vime's engines without waiting for them (the longest part of a run's start-up: its
        owner prepares the rest meanwhile); `start` waits."""
        args = self.args
        engines = EnginesConfig.of(args)
        router = RouterConfig.of(args)
        if engines.rollout_external_engine_addrs or self.engines:
            return
        if engine_dtype_warning(args):
            logger.warning(engine_dtype_warning(args))
        self.engines = self._given or [self.new_engine(rank) for rank in range(engines.num_engines())]
        self._launched = [e.start.remote() for e in self.engines]
        if not router.vllm_router_ip:  # our router boots beside them (1-2 s); they join it once they serve
            self.router = self._own_router(router.vllm_router_port or find_free_port(), [])
            self.router.launch()

    def start(self) -> list[str]:
        """Start (or connect to) the engines and the router; returns the engine URLs."""
        args = self.args
        engines = EnginesConfig.of(args)
        fault_tolerance = FaultToleranceConfig.of(args)
        if engines.rollout_external_engine_addrs:
            self.engine_urls = [f"http://{a}" for a in engines.rollout_external_engine_addrs]
            self._wait_for_external_engines()
        else:
            self.launch()
            self.engine_urls = gather(self._launched, "starting the engines", engines.engine_startup_timeout + 60,
                                      "--engine-startup-timeout")
        self.rank_urls = list(self.engine_urls)
        self._start_router()
        if self.gate is not None:
            self.gate.start()
        logger.info("engines %s behind router %s (custom functions: %s)", self.engine_urls, self.router_url,
                    self.plugin_router_url())
        if fault_tolerance.use_fault_tolerance and self.engines:
            self.recovery.start_monitor()
        return list(self.engine_urls)

    def _wait_for_external_engines(self) -> None:
        """Servers the user started may still be loading when the run starts (started side by side in a job
        script): wait for each one's /health, up to --engine-startup-timeout, then name those that never came."""
        engines = EnginesConfig.of(self.args)
        timeout = engines.engine_startup_timeout
        waiting = list(self.engine_urls)

        def all_up() -> bool:
            waiting[:] = [url for url in waiting if not http_ok(url + "/health")]
            return not waiting

        if not wait_until(all_up, timeout, 0.5):
            raise RuntimeError(f"--rollout-external-engine-addrs: {', '.join(waiting)} did not answer /health within "
                               f"--engine-startup-timeout {timeout:g}s; start them first, or check their address")

    def new_engine(self, rank: int):
        """Engine `rank`'s actor in its bundle, not started."""
        return new_engine(self.args, self.placement, rank, self.log_dir, self.token)

    def _start_router(self) -> None:
        args = self.args
        router = RouterConfig.of(args)
        if router.vllm_router_ip:  # an external router: register our engines with it
            self.router_url = f"http://{router.vllm_router_ip}:{router.vllm_router_port}"
            post_workers(self.token, self.router_url, "add_worker", self.engine_urls)
            return  # not ours to stop
        if self.router is not None:  # launched with the engines, before their URLs were known
            self.router_url = self.router.wait_ready()
            self.router.add_workers(self.engine_urls)
            return
        self.start_own_router(router.vllm_router_port or find_free_port())

    def _own_router(self, port: int, worker_urls: list[str]) -> Router:
        # loopback, and every route asks for the serving key (`router_door`); rollouts run in this process
        def args_on(port: int):
            return router_args_from(self.args, "127.0.0.1", port, worker_urls, api_key=self.token.serving_key())

        given_port = RouterConfig.of(self.args).vllm_router_port
        # a port vime chose may be taken before the router binds it: then the router starts again on a new one
        relaunch = None if given_port else lambda: args_on(find_free_port())
        return Router(args_on(port), str(self.log_dir), self.token, relaunch_args=relaunch)

    def start_own_router(self, port: int) -> None:
        """vime's router on loopback `port`, every engine in service registered, holding the serving key."""
        self.router = self._own_router(port, self.engine_urls)
        self.router_url = self.router.start()

    def shutdown(self) -> None:
        self.recovery.stop()
        if self.gate is not None:
            self.gate.stop()
            self.gate = None
        stops = [e.stop.remote() for e in self.engines]  # all at once, the router meanwhile: each waits its exit
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.engines:
            for e, stop in zip(self.engines, stops):
                try:
                    ray.get(stop, timeout=60)
                except Exception as err:  # a dead engine (fault tolerance): its actor's watchdog killed it
                    logger.warning("stopping an engine: %s", type(err).__name__)
                ray.kill(e)
            self.engines = []

    def engine_pids(self) -> list[int]:
        return control([e.pid.remote() for e in self.engines], "the engines' process ids")

    # ---- engine control (every engine, never through the router) ---------------------------------------------
    def post_engines(self, route: str, body: dict | None = None, params: dict | None = None) -> None:
        """POST to every engine in service. With fault tolerance an engine that fails the call and its health
        probe is taken out of service (the monitor restarts it); otherwise any failure raises."""
        with self.lock:
            if self.recovery.monitor is None:
                client.post_all(self.token, self.engine_urls, route, body, params)
                return
            _, errors = client.post_each(self.token, list(self.engine_urls), route, body, params)
            self.recovery.settle(errors)

    def sleep(self) -> None:
        """Free engine memory while the trainer uses the shared devices (--colocate --offload-rollout): vLLM's sleep
        level 1 copies each engine's weights to host memory and discards its KV cache (GPU engines started in sleep
        mode: `engine.memory_engine_options`; on CPU vLLM only pauses the engine)."""
        with self.lock:
            self.post_engines("/sleep", params={"level": 1})
            self.asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back `tags` of the sleeping engines' memory, or all of it (None): "weights" to load an update into,
        then "kv_cache" to generate, once the trainer has freed the shared devices (`train.py`). Only what sleeps
        is asked for (`/wake_up?tags=...`); when nothing does, nothing is sent. Once all is awake, engines that
        died while asleep are restarted (`FleetRecovery.after_wake_up`)."""
        unknown = set(tags or ()) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up: {sorted(unknown)} are none of vLLM's sleep tags {SLEEP_TAGS}")
        with self.lock:
            waking = [t for t in SLEEP_TAGS if t in self.asleep and (tags is None or t in tags)]
            if not waking:
                return
            self.post_engines("/wake_up", params={"tags": waking})
            self.asleep -= set(waking)
            awake = not self.asleep
        if awake:
            self.recovery.after_wake_up()

    def match_sleep(self, url: str) -> None:
        """A (restarted) engine joining the fleet sleeps as much as the others do."""
        if not self.asleep:
            return
        client.post_all(self.token, [url], "/sleep", params={"level": 1})
        awake = [t for t in SLEEP_TAGS if t not in self.asleep]
        if awake:
            client.post_all(self.token, [url], "/wake_up", params={"tags": awake})

    def apply_weights(self, transport, handle, version: int, recovery_dir: str | None = None,
                      pause_mode: str = "wait") -> dict[str, float]:
        """Every engine at once: pause -> load `transport`'s update -> reset the prefix cache -> weight `version`
        -> resume. `recovery_dir`: an HF directory of the same weights (--use-fault-tolerance), kept for engines
        restarted later. `pause_mode` "keep": an in-flight update, running requests continue under the new weights
        (their KV recomputed). Returns the slowest engine's {"pause_s", "load_s", "finish_s"}."""
        with self.lock:
            targets = list(self.engine_urls)
            connected = transport.bound_engines(handle)
            calls = {}
            if connected is not None and recovery_dir is not None:
                # an update bound to the engine set it was made for (broadcast): an engine restarted since then
                # loads the same weights from the recovery copy
                recovery_call = recovery_load_call(self.args, recovery_dir)
                calls = {u: recovery_call for u in targets if u not in connected}
            calls.update(transport.load_calls([u for u in targets if u not in calls], handle))
            answers, errors = client.update_weights_each(self.token, targets, calls, version, pause_mode,
                                                         all_at_once=transport.concurrent)
            self.recovery.settle(errors)  # a dead engine gets these weights when it is restarted
            if recovery_dir is not None:
                self.recovery.set_recovery_weights(recovery_dir)
            self.served_version = version
        slowest: dict[str, float] = {}
        for answer in answers.values():
            for phase, seconds in answer.get("timings", {}).items():
                slowest[phase] = max(seconds, slowest.get(phase, 0.0))
        return slowest

    def probe_log_probs(self, tokens: list[int], model: str = client.SERVED_MODEL) -> list[list[float]]:
        """Every engine's prompt log-probs of `tokens` under served model `model` (--check-weight-update-equal)."""
        from vime.transport.weights.check import engine_prompt_log_probs

        return engine_prompt_log_probs(self.token, self.engine_urls, tokens, model=model)

    def spec_counters(self) -> dict[str, dict[str, float]] | None:
        """{url: speculative-decoding counters} of the engines in service (`spec_counters.parse_counters`; an
        engine that does not answer is left out, and logged), or None when the engines do not draft."""
        from vime.engine.control.spec_counters import parse_counters

        if not self.speculative:
            return None
        texts, errors = client.metrics_each(self.token, list(self.engine_urls))
        for url, error in errors.items():
            logger.warning("engine %s: its speculative-decoding counters could not be read: %s", url, error)
        return {url: parse_counters(text) for url, text in texts.items()}
