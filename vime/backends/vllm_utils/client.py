"""Control calls sent to every engine directly (never through the router, which picks only one)."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx


class EngineControlError(RuntimeError):
    pass


@functools.cache
def http() -> httpx.Client:
    """One client per process: `httpx.post` builds a new client, and its TLS context costs ~50 ms per call."""
    return httpx.Client()


def _post(url: str, route: str, body: dict | None, params: dict | None, timeout: float) -> Any:
    try:
        r = http().post(f"{url}{route}", json=body if body is not None else {}, params=params, timeout=timeout)
    except httpx.HTTPError as e:
        raise EngineControlError(f"engine {url}: POST {route} failed: {e!r}") from e
    if r.status_code >= 400:
        raise EngineControlError(f"engine {url}: POST {route} -> HTTP {r.status_code}: {r.text[:500]}")
    try:
        return r.json()
    except ValueError:
        return r.text


def post_each(urls: list[str], route: str, body: dict | None = None, params: dict | None = None,
              timeout: float = 300.0) -> tuple[dict[str, Any], dict[str, str]]:
    """POST to `route` on every engine at once; returns ({url: answer}, {url: error}) for those that failed."""
    if not urls:
        return {}, {}
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        futures = {u: pool.submit(_post, u, route, body, params, timeout) for u in urls}
        results, errors = {}, {}
        for url, f in futures.items():
            try:
                results[url] = f.result()
            except EngineControlError as e:
                errors[url] = str(e)
    return results, errors


def post_all(urls: list[str], route: str, body: dict | None = None, params: dict | None = None,
             timeout: float = 300.0) -> list[Any]:
    """POST to `route` on every engine at once; raise naming the engine(s) that failed."""
    results, errors = post_each(urls, route, body, params, timeout)
    if errors:
        raise EngineControlError("; ".join(errors.values()))
    return [results[u] for u in urls]


def pause(urls: list[str], mode: str = "wait") -> None:
    """mode: 'wait' lets in-flight requests finish, 'abort' cancels them, 'keep' freezes them until resume."""
    post_all(urls, "/pause", params={"mode": mode})


def resume(urls: list[str]) -> None:
    post_all(urls, "/resume")


def abort_all(urls: list[str]) -> None:
    """Abort every in-flight request on every engine (the dev-mode route with an empty id list)."""
    post_all(urls, "/abort_requests", body={})


def reset_prefix_cache(urls: list[str]) -> None:
    post_all(urls, "/reset_prefix_cache")


def update_weight_version(urls: list[str], version: str) -> None:
    post_all(urls, "/update_weight_version", body={"new_version": str(version)})


def collective_rpc(urls: list[str], method: str, kwargs: dict[str, str] | None = None,
                   timeout: float = 600.0) -> list[Any]:
    """Run a worker method on every engine; only string arguments survive the HTTP route."""
    return post_all(urls, "/collective_rpc", body={"method": method, "kwargs": kwargs or {}}, timeout=timeout)
