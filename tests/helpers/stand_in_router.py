"""A stand-in for vllm-router in unit tests of the code around it: an aiohttp server on loopback, on a loop of its
own, answering POST /inference/v1/generate with what a subclass's `_generate(request)` returns."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class StandInRouter:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self._generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _generate(self, request: web.Request) -> web.Response:
        raise NotImplementedError

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
