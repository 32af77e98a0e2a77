"""The control plane at scale: vime's engine fleet driving N stand-in engines behind the real vllm-router.
Prints, for N = 8, 64, 256, 1000, each operation's wall time, the driver's CPU time, its peak RSS growth and its
peak thread count, then each operation's slope (time per engine from a linear fit, the exponent of a log-log fit).

    .venv/bin/python bench/control_plane.py [--engines 8 64 256 1000 --latency-ms 5 --repeats 3]

The stand-ins (`standin_engines.py`: asyncio HTTP servers, one port each, two processes) answer every route
after a fixed latency and run no model. The fleet is vime's own `EngineFleet`, in this process without Ray: its
engine handles are stand-ins whose start / stop / is_alive answer at once (a real run adds one Ray call per
engine probed). The operations, as a run does them:
- registration: every engine added to the router (`EngineFleet._start_router`, the router already serving);
- health sweep: the monitor's check of the router and of every engine (`EngineHealthMonitor.check_once`);
- weight update: `EngineFleet.apply_weights` (one /vime/update_weights per engine);
- pause/resume: `EngineFleet.sleep` then `wake_up` (a colocated run's pause of generation);
- abort: a rollout's abort on every engine (`client.post_each(..., "/abort_requests")`, as `vllm_rollout`);
- restart: one engine taken out, replaced, given the current weights, registered (`FleetRecovery.restart_engine`);
- raw: the limit, N bare POSTs with the same HTTP client (httpx, a thread each) at vime's fan-out concurrency;
- raw asyncio: the same POSTs from one event loop (aiohttp), what a cheaper client would cost.
Each N runs in a fresh process (its memory is its own); each operation's median of --repeats is shown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STANDIN_HOSTS = 2  # processes serving the stand-ins (this machine's cores)
OPERATIONS = ("registration", "health sweep", "weight update", "pause/resume", "abort", "restart one", "raw",
              "raw asyncio")


# ---- stand-in engines ------------------------------------------------------------------------------------------
class StandInHost:
    """One `standin_engines.py` process and its admin URL."""

    def __init__(self, token: str, latency_s: float):
        self.token = token
        self.proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "standin_engines.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.proc.stdin.write(json.dumps({"token": token, "latency_s": latency_s}) + "\n")
        self.proc.stdin.flush()
        self.admin = self.proc.stdout.readline().strip()

    def _call(self, path: str, method: str = "POST"):
        req = urllib.request.Request(self.admin + path, method=method,
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def open(self, count: int) -> list[str]:
        return self._call(f"/open?count={count}")["urls"]

    def close(self, url: str) -> None:
        self._call(f"/close?url={urllib.request.quote(url, safe='')}")

    def served(self) -> dict[str, int]:
        return self._call("/served", "GET")

    def stop(self) -> None:
        self.proc.stdin.close()  # its signal to exit
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Call:
    """An actor method's stand-in: `.remote()` runs it at once; the Ray stand-in's `get` returns the value."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class StandInEngine:
    """What the fleet holds for an engine actor (`VLLMEngine`): start, stop, is_alive, pid."""

    def __init__(self, host: StandInHost, url: str | None = None):
        self.host, self.url = host, url
        self.start, self.stop = Call(self._start), Call(self._stop)
        self.is_alive, self.pid = Call(lambda: self.url is not None), Call(lambda: None)

    def _start(self) -> str:
        self.url = self.host.open(1)[0]
        return self.url

    def _stop(self) -> None:
        if self.url is not None:
            self.host.close(self.url)
            self.url = None


class RayStandIn:
    """Replaces `ray` in `vime.rollout_manager.engine_fleet` and `vime.rollout_manager.fleet_recovery`: no cluster,
    the stand-in engines answer directly."""

    @staticmethod
    def get(value, timeout=None):
        return value

    @staticmethod
    def kill(actor, no_restart=True):
        actor._stop()


class StandInTransport:
    """A weight transport whose update every engine loads on its own (as the disk transport's)."""

    concurrent = False  # no collective: the fleet's fan-out is bounded

    def bound_engines(self, handle):
        return None

    def load_calls(self, urls, handle):
        return {u: ("reload_weights", {"path": handle}) for u in urls}


# ---- measuring -------------------------------------------------------------------------------------------------
def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def thread_count() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


class PeakSampler:
    """The driver's peak RSS and thread count while an operation runs (read every 5 ms)."""

    def __init__(self):
        self.rss, self.threads = rss_mb(), thread_count()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(0.005):
            self.rss, self.threads = max(self.rss, rss_mb()), max(self.threads, thread_count())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


def measure(op) -> dict:
    before = rss_mb()
    cpu0, t0 = time.process_time(), time.perf_counter()
    with PeakSampler() as peak:
        op()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"wall_s": wall, "cpu_s": cpu, "rss_mb": max(0.0, peak.rss - before), "threads": peak.threads - 1}


def median_of(samples: list[dict]) -> dict:
    return {"wall_s": statistics.median(s["wall_s"] for s in samples),
            "cpu_s": statistics.median(s["cpu_s"] for s in samples),
            "rss_mb": max(s["rss_mb"] for s in samples), "threads": max(s["threads"] for s in samples)}


# ---- one N, in its own process ---------------------------------------------------------------------------------
def build_fleet(n: int, hosts: list[StandInHost], log_dir: Path, token):
    """vime's fleet over `n` stand-in engines (fault tolerance on: the path a large run takes), its router
    launched with no worker yet, as `EngineFleet.launch` leaves it."""
    from vime.arguments import parse_args
    from vime.rollout_manager import engine_fleet, fleet_recovery
    from vime.rollout.context import RolloutContext
    from vime.utils.misc import find_free_port

    engine_fleet.ray = fleet_recovery.ray = RayStandIn
    args = parse_args(["--use-fault-tolerance"], validate=False)
    fleet = engine_fleet.EngineFleet(args, None, log_dir, RolloutContext(token=token), engines=[])
    fleet.gate = None  # the custom functions' front: not part of the control plane measured here
    per_host = [n // len(hosts) + (i < n % len(hosts)) for i in range(len(hosts))]
    fleet.engines = [StandInEngine(h, url) for h, count in zip(hosts, per_host) for url in h.open(count)]
    fleet.engine_urls = [e.url for e in fleet.engines]
    fleet.rank_urls = list(fleet.engine_urls)
    fleet.new_engine = lambda rank: StandInEngine(hosts[rank % len(hosts)])
    fleet.router = fleet._own_router(find_free_port(), [])
    fleet.router.start()
    fleet.recovery.monitor = fleet.recovery.health_monitor()
    return fleet


def deregister_all(fleet) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(fleet.router.remove_worker, fleet.router.workers()))


def check_served(fleet, n: int) -> None:
    """The router serves all n stand-ins and forwards a generate request to one."""
    workers = fleet.router.workers()
    assert len(workers) == n, f"the router serves {len(workers)} workers, not {n}"
    req = urllib.request.Request(fleet.router_url + "/inference/v1/generate", method="POST",
                                 data=json.dumps({"token_ids": [1], "sampling_params": {"max_tokens": 1}}).encode(),
                                 headers={**fleet.token.serving_headers(), "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.loads(r.read())["choices"][0]["token_ids"] == [0]


def raw_posts(urls: list[str], concurrency: int, headers: dict[str, str]) -> None:
    from vime.engine.control import client

    def one(url):
        client.http().post(url + "/abort_requests", json={}, timeout=300, headers=headers).raise_for_status()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, urls))


def raw_posts_asyncio(urls: list[str], concurrency: int, headers: dict[str, str]) -> None:
    import asyncio

    import aiohttp

    async def all_posts():
        limit = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            async def one(url):
                async with limit, session.post(url + "/abort_requests", json={}, headers=headers) as r:
                    r.raise_for_status()
                    await r.read()

            await asyncio.gather(*(one(u) for u in urls))

    asyncio.run(all_posts())


def fanout_limit(n: int) -> int:
    from vime.engine.control import client

    return min(n, getattr(client, "CONTROL_FANOUT", n))


def run_operations(fleet, n: int, repeats: int) -> dict[str, dict]:
    from vime.engine.control import client

    samples: dict[str, list[dict]] = {op: [] for op in OPERATIONS}
    for i in range(repeats):
        if i:
            deregister_all(fleet)
        samples["registration"].append(measure(fleet._start_router))
    check_served(fleet, n)
    for i in range(repeats):
        samples["health sweep"].append(measure(fleet.recovery.monitor.check_once))
        samples["weight update"].append(measure(lambda: fleet.apply_weights(StandInTransport(), "/w", i + 1)))
        samples["pause/resume"].append(measure(lambda: (fleet.sleep(), fleet.wake_up())))
        samples["abort"].append(measure(lambda: client.post_each(fleet.token, list(fleet.engine_urls),
                                                                 "/abort_requests", {})))
        samples["restart one"].append(measure(lambda: fleet.recovery.restart_engine(i, "benchmark")))
        control = fleet.token.control_headers()
        samples["raw"].append(measure(lambda: raw_posts(list(fleet.engine_urls), fanout_limit(n), control)))
        samples["raw asyncio"].append(measure(lambda: raw_posts_asyncio(list(fleet.engine_urls), fanout_limit(n),
                                                                        control)))
    check_served(fleet, n)
    return {op: median_of(s) for op, s in samples.items()}


def one_n(n: int, latency_s: float, repeats: int) -> dict[str, dict]:
    from vime.utils.auth import RunToken

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a connection per engine, the router's too
    token = RunToken.new()
    hosts, fleet = [], None
    with tempfile.TemporaryDirectory(prefix="vime_control_plane_") as log_dir:
        try:
            hosts = [StandInHost(token.control, latency_s) for _ in range(STANDIN_HOSTS)]
            fleet = build_fleet(n, hosts, Path(log_dir), token)
            return run_operations(fleet, n, repeats)
        finally:
            if fleet is not None and fleet.router is not None:
                fleet.router.stop()
            for h in hosts:
                h.stop()


# ---- the table -------------------------------------------------------------------------------------------------
def linear_slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def loglog_exponent(xs: list[float], ys: list[float]) -> float:
    return linear_slope([math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys])


def print_table(results: dict[int, dict[str, dict]]) -> None:
    ns = sorted(results)
    print(f"{'operation':<14}{'N':>6}{'wall ms':>10}{'cpu ms':>10}{'peak RSS +MB':>14}{'peak threads':>14}")
    for op in OPERATIONS:
        for n in ns:
            r = results[n][op]
            print(f"{op:<14}{n:>6}{r['wall_s'] * 1e3:>10.1f}{r['cpu_s'] * 1e3:>10.1f}{r['rss_mb']:>14.1f}"
                  f"{r['threads']:>14d}")
    if len(ns) < 2:
        return  # no slope from one N
    tail = ns[-2:]
    print(f"\n{'operation':<14}{'wall ms/engine':>16}{'wall exp':>10}{'exp ' + '-'.join(map(str, tail)):>14}"
          f"{'cpu ms/engine':>15}{'cpu exp':>9}{'RSS KB/engine':>15}")
    for op in OPERATIONS:
        wall = [results[n][op]["wall_s"] * 1e3 for n in ns]
        cpu = [results[n][op]["cpu_s"] * 1e3 for n in ns]
        rss = [results[n][op]["rss_mb"] * 1024 for n in ns]
        print(f"{op:<14}{linear_slope(ns, wall):>16.3f}{loglog_exponent(ns, wall):>10.2f}"
              f"{loglog_exponent(tail, wall[-2:]):>14.2f}{linear_slope(ns, cpu):>15.3f}"
              f"{loglog_exponent(ns, cpu):>9.2f}{linear_slope(ns, rss):>15.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, nargs="+", default=[8, 64, 256, 1000])
    p.add_argument("--latency-ms", type=float, default=5.0, help="each stand-in's answer time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # one N, its results as JSON
    a = p.parse_args()
    if a.child is not None:
        print(json.dumps(one_n(a.child, a.latency_ms / 1e3, a.repeats)))
        return
    results = {}
    for n in a.engines:
        out = subprocess.run([sys.executable, __file__, "--child", str(n), "--latency-ms", str(a.latency_ms),
                              "--repeats", str(a.repeats)], capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            sys.exit(f"N={n} failed:\n{out.stderr[-4000:]}")
        results[n] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"N={n} done", file=sys.stderr, flush=True)
    print(f"stand-in latency {a.latency_ms:g} ms, median of {a.repeats}; fan-out limit "
          f"{fanout_limit(max(a.engines))} at N={max(a.engines)}\n")
    print_table(results)


if __name__ == "__main__":
    main()
