"""Control calls sent to every engine directly (never through the router, which picks only one), each carrying
the run's control token: every call takes the caller's `RunToken` (`vime.utils.auth`)."""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx

from vime.utils.auth import RunToken


SERVED_MODEL = "policy"  # the model name every request asks the engines for (with LoRA: the current adapter)
# At most this many control calls in flight from one process: a thread and a connection each. Past it, a fleet's
# calls run in waves (1,000 engines: 8), which keeps the driver's threads and sockets (a common open-file limit
# is 1,024) bounded. A collective weight update is the exception: every receiver must be in it at once.
CONTROL_FANOUT = 128
# Idle connections kept for reuse (httpx's default): every request scans them all, which at 128 cost 7 ms of CPU
# per request, at 20 about 1 ms (128 calls in flight to 500 stand-in engines, `bench/standin_engines.py`); a
# fleet of a few engines still reuses its connections.
KEEPALIVE_CONNECTIONS = 20


class EngineControlError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the engine's HTTP status, None when it did not answer


@functools.cache
def http() -> httpx.Client:
    """One client per process: `httpx.post` builds a new client, and its TLS context costs ~50 ms per call. It
    holds no credentials: each request carries its caller's (`RunToken.control_headers`), so runs in one process
    share the connections and not the secret. Connections are not capped here (httpx's default, 100, would hold
    back a collective update's receivers past the hundredth until the others time out): the fan-outs bound them
    (`CONTROL_FANOUT`)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS)
    return httpx.Client(limits=limits)


def _post(token: RunToken, url: str, route: str, body: dict | None, params: dict | None, timeout: float) -> Any:
    try:
        r = http().post(f"{url}{route}", json=body if body is not None else {}, params=params, timeout=timeout,
                        headers=token.control_headers())
    except httpx.HTTPError as e:
        raise EngineControlError(f"engine {url}: POST {route} failed: {e!r}") from e
    if r.status_code >= 400:
        raise EngineControlError(f"engine {url}: POST {route} -> HTTP {r.status_code}: {r.text[:500]}",
                                 r.status_code)
    try:
        return r.json()
    except ValueError:
        return r.text


def _get_text(token: RunToken, url: str, route: str, timeout: float) -> str:
    try:
        r = http().get(f"{url}{route}", timeout=timeout, headers=token.control_headers())
    except httpx.HTTPError as e:
        raise EngineControlError(f"engine {url}: GET {route} failed: {e!r}") from e
    if r.status_code >= 400:
        raise EngineControlError(f"engine {url}: GET {route} -> HTTP {r.status_code}: {r.text[:500]}", r.status_code)
    return r.text


def _each(urls: list[str], call: Callable[[str], Any], all_at_once: bool = False) -> tuple[dict[str, Any],
                                                                                          dict[str, str]]:
    """`call(url)` for every engine, `CONTROL_FANOUT` at a time (`all_at_once`: every one together, for a
    collective); returns ({url: answer}, {url: error}) for those that failed."""
    if not urls:
        return {}, {}
    with ThreadPoolExecutor(max_workers=len(urls) if all_at_once else min(len(urls), CONTROL_FANOUT)) as pool:
        futures = {u: pool.submit(call, u) for u in urls}
        results, errors = {}, {}
        for url, f in futures.items():
            try:
                results[url] = f.result()
            except EngineControlError as e:
                errors[url] = str(e)
    return results, errors


def _all(urls: list[str], results: dict[str, Any], errors: dict[str, str]) -> list[Any]:
    if errors:
        raise EngineControlError("; ".join(errors.values()))
    return [results[u] for u in urls]


def post_each(token: RunToken, urls: list[str], route: str, body: dict | None = None, params: dict | None = None,
              timeout: float = 300.0) -> tuple[dict[str, Any], dict[str, str]]:
    """POST to `route` on every engine (`CONTROL_FANOUT` at a time); returns ({url: answer}, {url: error}) for
    those that failed."""
    return _each(urls, lambda url: _post(token, url, route, body, params, timeout))


def post_all(token: RunToken, urls: list[str], route: str, body: dict | None = None, params: dict | None = None,
             timeout: float = 300.0) -> list[Any]:
    """POST to `route` on every engine (`CONTROL_FANOUT` at a time); raise naming the engine(s) that failed."""
    return _all(urls, *post_each(token, urls, route, body, params, timeout))


def metrics_each(token: RunToken, urls: list[str], timeout: float = 10.0) -> tuple[dict[str, str], dict[str, str]]:
    """Every engine's Prometheus text (`/metrics`); returns ({url: text}, {url: error}) for those that failed."""
    return _each(urls, lambda url: _get_text(token, url, "/metrics", timeout))


def pause(token: RunToken, urls: list[str], mode: str = "wait") -> None:
    """mode: 'wait' lets in-flight requests finish, 'abort' cancels them, 'keep' freezes them until resume."""
    post_all(token, urls, "/pause", params={"mode": mode})


def resume(token: RunToken, urls: list[str]) -> None:
    post_all(token, urls, "/resume")


def abort_all(token: RunToken, urls: list[str]) -> None:
    """Abort every in-flight request on every engine (the dev-mode route with an empty id list)."""
    post_all(token, urls, "/abort_requests", body={})


def reset_prefix_cache(token: RunToken, urls: list[str], running_requests: bool = False) -> None:
    """`running_requests`: also preempt running requests, whose KV is then recomputed when they resume. Raises
    naming the engines whose cache could not be reset (vLLM answers {"success": false}): cached prefixes of the
    old weights must not be served."""
    answers = post_all(token, urls, "/reset_prefix_cache",
                       params={"reset_running_requests": "true"} if running_requests else None)
    failed = [u for u, a in zip(urls, answers) if isinstance(a, dict) and a.get("success") is False]
    if failed:
        raise EngineControlError(f"engines {failed}: the prefix cache could not be reset")


def update_weight_version(token: RunToken, urls: list[str], version: str) -> None:
    post_all(token, urls, "/update_weight_version", body={"new_version": str(version)})


def collective_rpc(token: RunToken, urls: list[str], method: str, kwargs: dict[str, str] | None = None,
                   timeout: float = 600.0) -> list[Any]:
    """Run a worker method on every engine; only string arguments survive the HTTP route."""
    return post_all(token, urls, "/collective_rpc", body={"method": method, "kwargs": kwargs or {}}, timeout=timeout)


# ---- a whole weight update ---------------------------------------------------------------------------------------
LoadCall = tuple[str, dict[str, str]] | None  # (worker method, string kwargs) that loads an update; None: nothing
UPDATE_TIMEOUT_S = 900.0  # outlasts a broadcast group's 600 s join timeout, so that one reports first


def update_weights_each(token: RunToken, urls: list[str], calls: dict[str, LoadCall], version: int | str,
                        pause_mode: str = "wait", timeout: float = UPDATE_TIMEOUT_S,
                        all_at_once: bool = False) -> tuple[dict[str, dict], dict[str, str]]:
    """On every engine: pause -> `calls[url]` -> reset prefix cache -> weight version -> resume.

    One POST to vime's route (`vime.engine.in_vllm.endpoint_plugin`) per engine, or, for an engine without it, the
    same steps as separate control calls; `CONTROL_FANOUT` engines at a time, or all of them with `all_at_once`
    (a broadcast needs every receiver in the collective). Returns ({url: {"results", "timings"}}, {url: error});
    a failed engine stays paused."""
    return _each(urls, lambda url: _update_one(token, url, calls.get(url), str(version), pause_mode, timeout),
                 all_at_once)


def update_weights_all(token: RunToken, urls: list[str], calls: dict[str, LoadCall], version: int | str,
                       pause_mode: str = "wait", timeout: float = UPDATE_TIMEOUT_S) -> list[dict]:
    """`update_weights_each`, raising naming the engine(s) that failed."""
    return _all(urls, *update_weights_each(token, urls, calls, version, pause_mode, timeout))


def _update_one(token: RunToken, url: str, call: LoadCall, version: str, pause_mode: str, timeout: float) -> dict:
    from vime.engine.protocol.names import LOAD_ADAPTER, UPDATE_ROUTE

    body = {"method": call[0] if call else None, "kwargs": call[1] if call else {}, "version": version,
            "pause_mode": pause_mode}
    try:
        return _post(token, url, UPDATE_ROUTE, body, None, timeout)
    except EngineControlError as e:
        if e.status != 404:  # 404: a server started without vime's plugin (asked again each update: one request)
            raise
    if call and call[0] == LOAD_ADAPTER:
        raise EngineControlError(f"engine {url} has no vime route ({UPDATE_ROUTE}) to load a LoRA adapter with: it "
                                 "was not started by vime; train with --lora-sync merged to send it merged weights")
    start = time.perf_counter()
    pause(token, [url], pause_mode)
    paused = time.perf_counter()
    answer = collective_rpc(token, [url], call[0], call[1], timeout)[0] if call else {}
    results = answer.get("results", []) if isinstance(answer, dict) else []
    loaded = time.perf_counter()
    reset_prefix_cache(token, [url], running_requests=pause_mode == "keep")
    update_weight_version(token, [url], version)
    resume(token, [url])
    return {"results": results, "timings": {"pause_s": paused - start, "load_s": loaded - paused,
                                            "finish_s": time.perf_counter() - loaded}}
