"""vllm-router in front of the engines: started as a child process, workers registered by URL.

The router spreads generate requests over engines. Control calls (pause, weight updates, ...) must not go
through it: it forwards them to one worker only. See `vime.engine.control.client`.
Every route of vime's router, its admin routes included, admits only callers that carry the run's serving key
(`router_door`): `router_ok`, `post_worker` and `Router.workers` send it, made from the `RunToken` they are given.
Its Prometheus endpoint (worker URLs, request counts) cannot be turned off or guarded in vllm-router 0.1.17: it
listens on a free loopback port unless --router-prometheus-port names one (docs/guides/security.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vime.engine.control.engine import http_status
from vime.utils.auth import RunToken
from vime.utils.listeners import foreign_listener, listeners
from vime.utils.process import PORT_ATTEMPTS, kill_tree, lost_port_race, spawn, tail, wait_until

# add_worker / remove_worker calls in flight to the router at once: the router checks a new worker's /health
# before it answers, so one at a time costs a fleet of 1,000 engines 1,000 of those round trips in a row
REGISTER_FANOUT = 16

logger = logging.getLogger(__name__)


class Router:
    """`router_args.api_key`, when set, is `token.serving_key()`: the key every caller of the router needs.

    `relaunch_args`, when given, makes the router's arguments again on freshly chosen ports: a router that exits
    because another process bound its port first (chosen free, taken before the router bound it) starts again on
    new ones, as an engine does."""

    def __init__(self, router_args, log_dir: str, token: RunToken, relaunch_args: Callable[[], object] | None = None):
        self.router_args = router_args
        self.token = token  # what this handle's own calls (/health, /workers, worker registration) carry
        self.relaunch_args = relaunch_args
        self.url = f"http://{router_args.host}:{router_args.port}"
        self.log_path = Path(log_dir) / "router.log"
        self.proc = None
        self._log_offset = 0  # where this launch's output begins in the log

    def start(self, timeout_s: float = 60.0) -> str:
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the router's process without waiting for it to serve."""
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        # on standard input, not argv: the arguments hold the serving key (api_key)
        payload = json.dumps(dataclasses.asdict(self.router_args)).encode()
        self.proc = spawn([sys.executable, "-m", "vime.engine.control.router"], self.log_path,
                          stdin_data=payload)

    def wait_ready(self, timeout_s: float = 60.0) -> str:
        """Wait until the launched router answers /health; its URL. A router that lost its port to another
        process is launched again on new ports (`relaunch_args`), up to `PORT_ATTEMPTS` launches in all."""
        deadline = time.monotonic() + timeout_s
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if self._serving(deadline):
                return self.url
            if (self.relaunch_args is None or attempt == PORT_ATTEMPTS
                    or not lost_port_race(self.proc, self.log_path, self._log_offset)):
                break
            logger.warning("vllm-router: %s was taken before the router bound it; relaunching on a new port "
                           "(attempt %d of %d)", self.url, attempt + 1, PORT_ATTEMPTS)
            self.stop()
            self.router_args = self.relaunch_args()
            self.url = f"http://{self.router_args.host}:{self.router_args.port}"
            self.launch()
        self.stop()
        raise RuntimeError(f"vllm-router did not start on {self.url}. Log {self.log_path}:\n{tail(self.log_path)}")

    def _serving(self, deadline: float) -> bool:
        """Whether the launched router answers /health before `deadline`. The key goes only to a listener that is
        the router's own: first its port must be listening, and by the router's process."""
        alive = lambda: self.proc.poll() is None  # noqa: E731
        port = self.router_args.port
        if not wait_until(lambda: bool(listeners(port)), max(deadline - time.monotonic(), 0.0), 0.05, alive=alive):
            return False
        stranger = foreign_listener(port, self.proc.pid)
        if stranger is not None:  # /health and generate requests carry the serving key: none goes to a stranger
            self.stop()
            raise RuntimeError(f"vllm-router at {self.url}: {stranger}; nothing was sent to it. Another user may "
                               "be trying to impersonate the router: start the run again on another port")
        healthy = lambda: router_ok(self.token, self.url)  # noqa: E731
        return wait_until(healthy, max(deadline - time.monotonic(), 0.0), 0.1, alive=alive)

    def workers(self) -> list[str]:
        request = urllib.request.Request(self.url + "/workers", headers=self.token.serving_headers())
        with urllib.request.urlopen(request, timeout=10) as r:
            data = json.loads(r.read())
        return [w["url"] if isinstance(w, dict) else w for w in data.get("workers", data.get("urls", []))]

    def add_worker(self, url: str) -> None:
        post_worker(self.token, self.url, "add_worker", url)

    def add_workers(self, urls: list[str]) -> None:
        post_workers(self.token, self.url, "add_worker", urls)

    def remove_worker(self, url: str) -> None:
        post_worker(self.token, self.url, "remove_worker", url)

    def stop(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc, grace_s=3)
            self.proc = None


def router_ok(token: RunToken, router_url: str, timeout: float = 2.0) -> bool:
    """Whether the router at `router_url` answers /health (asked with the serving key, which it requires)."""
    return http_status(router_url + "/health", headers=token.serving_headers(), timeout=timeout) == 200


def post_worker(token: RunToken, router_url: str, route: str, worker_url: str) -> None:
    """Register (add_worker) or drop (remove_worker) an engine at any running vllm-router, ours or not."""
    query = urllib.parse.quote(worker_url, safe="")
    req = urllib.request.Request(f"{router_url}/{route}?url={query}", method="POST",
                                 headers=token.serving_headers())
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def post_workers(token: RunToken, router_url: str, route: str, worker_urls: list[str]) -> None:
    """`post_worker` for each of `worker_urls`, `REGISTER_FANOUT` at a time; raises the first failure."""
    if not worker_urls:
        return
    with ThreadPoolExecutor(min(len(worker_urls), REGISTER_FANOUT), thread_name_prefix="vime-router-workers") as pool:
        list(pool.map(lambda url: post_worker(token, router_url, route, url), worker_urls))


def _main() -> None:
    from vime.engine.control.router_door import open_door

    config = json.loads(sys.stdin.read())
    # callers need the key the router sends the engines (`router_door`); opened before anything starts a thread,
    # its socket held here while the router runs
    door_url, door_socket = open_door((config["api_key"],)) if config.get("api_key") else (None, None)

    from vllm_router.launch_router import launch_router
    from vllm_router.router_args import RouterArgs

    router_args = RouterArgs(**config)  # this process's own, made here
    if door_url is not None:
        router_args.api_key_validation_urls = [door_url]  # a _Router argument that RouterArgs does not declare
    try:
        launch_router(router_args)
    finally:
        if door_socket is not None:
            door_socket.close()


if __name__ == "__main__":
    _main()
