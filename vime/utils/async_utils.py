"""One long-lived asyncio loop in a background thread, so sync code (Ray actor methods) can run coroutines
while HTTP sessions and semaphores survive from one rollout to the next."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from typing import Any, Coroutine


class BackgroundLoop:
    """An asyncio loop running in a daemon thread of its own, (re)started on first use."""

    def __init__(self, name: str = "vime-async"):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True).start()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the loop and wait for its result (call from sync code only). The coroutine sees the
        caller's context variables (the rollout context among them), as `asyncio.to_thread` would give them."""
        return asyncio.run_coroutine_threadsafe(_in_context(contextvars.copy_context(), coro), self.loop()).result()


async def _in_context(context: contextvars.Context, coro: Coroutine[Any, Any, Any]) -> Any:
    for var, value in context.items():  # the task runs in a copy of the loop thread's context: carry the caller's
        var.set(value)
    return await coro


@functools.cache
def shared_loop() -> BackgroundLoop:
    """This process's loop (a per-process resource by design: the rollout's HTTP sessions and semaphores are bound
    to it and outlive each call)."""
    return BackgroundLoop()


def get_loop() -> asyncio.AbstractEventLoop:
    return shared_loop().loop()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` on this process's loop and wait for its result (call from sync code only)."""
    return shared_loop().run(coro)
