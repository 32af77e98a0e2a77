"""Stand-in engines for the control-plane benchmark (`control_plane.py`): many HTTP servers, one loopback port
each, in one asyncio process, that answer vime's engine routes after a fixed latency and run no model.

    python bench/standin_engines.py   # stdin: {"token": ..., "latency_s": 0.005}; prints its admin URL

Each stand-in asks for the keys a vime engine asks for (`route_auth.accepted_keys`: /health open, generation
routes the serving key or the control token, every other route the control token) and answers:
/vime/update_weights with zero timings, /reset_prefix_cache with success, /is_paused with false,
/inference/v1/generate with one token, anything else with {}. The admin port (same token) opens stand-ins
(`POST /open?count=k` -> {"urls": [...]}), closes one (`POST /close?url=...`) and reports the requests served
(`GET /served`). The process exits when its standard input closes.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
from collections import Counter
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vime.engine.in_vllm.route_auth import accepted_keys  # noqa: E402
from vime.utils.auth import bearer_matches, serving_key  # noqa: E402

ANSWERS = {
    "/vime/update_weights": {"results": [], "timings": {"pause_s": 0.0, "load_s": 0.0, "finish_s": 0.0}},
    "/reset_prefix_cache": {"success": True},
    "/is_paused": {"is_paused": False},
    "/inference/v1/generate": {"choices": [{"token_ids": [0], "logprobs": [0.0], "finish_reason": "length"}]},
}


class StandIns:
    def __init__(self, token: str, latency_s: float):
        self.token, self.key, self.latency_s = token, serving_key(token), latency_s
        self.sites: dict[str, web.SockSite] = {}
        self.served: Counter = Counter()
        self.runner: web.AppRunner | None = None

    async def engine(self, request: web.Request) -> web.Response:
        keys = accepted_keys(request.path, self.token, self.key)
        if keys and not bearer_matches(request.headers.get("Authorization"), keys):
            return web.json_response({"error": "unauthorized"}, status=401)
        await request.read()
        await asyncio.sleep(self.latency_s)  # what the engine's own work would take
        self.served[request.path] += 1
        return web.json_response(ANSWERS.get(request.path, {}))

    async def open(self, count: int) -> list[str]:
        urls = []
        for _ in range(count):
            site = web.TCPSite(self.runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            url = f"http://127.0.0.1:{port}"
            self.sites[url] = site
            urls.append(url)
        return urls

    async def admin(self, request: web.Request) -> web.Response:
        if not bearer_matches(request.headers.get("Authorization"), (self.token,)):
            return web.json_response({"error": "unauthorized"}, status=401)
        if request.path == "/open":
            return web.json_response({"urls": await self.open(int(request.query["count"]))})
        if request.path == "/close":
            site = self.sites.pop(request.query["url"], None)
            if site is not None:
                await site.stop()
            return web.json_response({"closed": site is not None})
        return web.json_response(dict(self.served))


async def serve(token: str, latency_s: float) -> None:
    standins = StandIns(token, latency_s)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", standins.engine)
    standins.runner = web.AppRunner(app, access_log=None)
    await standins.runner.setup()
    admin_app = web.Application()
    admin_app.router.add_route("*", "/{tail:.*}", standins.admin)
    admin_runner = web.AppRunner(admin_app, access_log=None)
    await admin_runner.setup()
    admin = web.TCPSite(admin_runner, "127.0.0.1", 0)
    await admin.start()
    print(f"http://127.0.0.1:{admin._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the benchmark goes away


def main() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a port and its connections per stand-in
    config = json.loads(sys.stdin.readline())
    asyncio.run(serve(config["token"], config["latency_s"]))


if __name__ == "__main__":
    main()
