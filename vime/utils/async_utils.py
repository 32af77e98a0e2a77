"""One long-lived asyncio loop in a background thread, so sync code (Ray actor methods) can run coroutines
while HTTP sessions and semaphores survive from one rollout to the next."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="vime-async", daemon=True).start()
        return _loop


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` on the background loop and wait for its result (call from sync code only)."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop()).result()
