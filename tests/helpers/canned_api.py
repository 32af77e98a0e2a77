"""A tiny aiohttp server in a background thread that answers one POST route with a handler of the test's, for
checking wire formats with the real `openai` and `anthropic` clients (no engine behind it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Awaitable, Callable, Iterator

from aiohttp import web


async def send_events(request: web.Request, events) -> web.StreamResponse:
    """`events` ((name, data) pairs) as server-sent events."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for name, data in events:
        await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
    await response.write_eof()
    return response


@contextlib.contextmanager
def serve(route: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Iterator[str]:
    """Serve POST `route` with `handler`; yields the server's root URL (http://127.0.0.1:PORT)."""
    async def start():
        app = web.Application()
        app.router.add_post(route, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
