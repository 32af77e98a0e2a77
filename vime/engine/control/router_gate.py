"""The router's address as custom functions see it: a loopback front that admits the run's own user only and
adds the serving key.

vime's engines answer generation only to requests that carry the run's serving key (`in_vllm.route_auth`); vllm-router
passes a request's Authorization header on and adds none of its own. vime's own generate calls send the key; a
function written for slime posts to `http://{args.sglang_router_ip}:{args.sglang_router_port}/generate` with no
key at all. The gate stands between the two: `args.vllm_router_ip` / `args.vllm_router_port` of the plugin view
(`vime.utils.plugin_args`) point at it, and it
- answers only connections from a process of this user (the peer socket's owner, read from /proc/net/tcp and
  tcp6): another user on the node gets 403 and never reaches the engines through it;
- forwards GET (the router's `/workers`, `/list_workers`, `/health`, ...) and the generation routes' POST
  (`engine.protocol.names.SERVING_PATHS`) to the router in service at that moment (a restarted router moves; the
  gate does not), with the serving key in place of any Authorization header given, streaming the answer back; the
  router's control routes (`/add_worker`, `/remove_worker`, `/flush_cache`, ...) are refused: the fleet owns the
  worker set;
- reads a body only after those checks, within `max_body_bytes` (413 beyond, before reading when the
  Content-Length says so) and `body_timeout_s` (408), and gives up on a router that sends nothing for
  `router_read_timeout_s`.

It serves from its own thread and event loop, so that a plugin that calls it synchronously from vime's rollout loop
does not wait on itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable

import aiohttp
from aiohttp import web

from vime.engine.protocol.names import SERVING_PATHS
from vime.utils.listeners import peer_uid

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 2**20  # a generate request is token ids and sampling params: kilobytes to megabytes
DEFAULT_BODY_TIMEOUT_S = 60.0  # a plugin on this node sends its body at once
# vllm-router's own --router-request-timeout-secs default: the router gives up on an engine by then
DEFAULT_ROUTER_READ_TIMEOUT_S = 1800.0

# headers that describe one hop, not the request (RFC 9110 7.6.1), and the ones the gate sets itself
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                          "transfer-encoding", "upgrade", "host", "content-length", "authorization"})


def forwarded(method: str, path: str) -> bool:
    """Whether the gate passes `method path` on to the router: any GET, and POST to a generation route."""
    return method in ("GET", "HEAD") or (method == "POST" and path in SERVING_PATHS)


class RouterGate:
    """`RouterGate(router_url, headers)`: `router_url()` is the router in service now (None while there is none),
    `headers()` the key every forwarded request carries. `url` is known from construction (the socket is bound
    there); `start()` serves, `stop()` closes."""

    def __init__(self, router_url: Callable[[], str | None], headers: Callable[[], dict[str, str]],
                 host: str = "127.0.0.1", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 router_read_timeout_s: float = DEFAULT_ROUTER_READ_TIMEOUT_S):
        self.router_url, self.headers = router_url, headers
        self.max_body_bytes, self.body_timeout_s = int(max_body_bytes), body_timeout_s
        self.router_read_timeout_s = router_read_timeout_s
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))  # held from now on: the port is ours before anyone learns it
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.uid = os.getuid()
        self.refused = 0  # connections of another user, refused since start
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> str:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="vime-router-gate", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError(f"the router gate at {self.url} did not start")
        return self.url

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def setup():
            app = web.Application(client_max_size=self.max_body_bytes)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            self.sock.listen(1024)
            await web.SockSite(self._runner, self.sock).start()
            # no total: a streamed answer may run long; but a router silent that long is gone
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.router_read_timeout_s)
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)

        self._loop.run_until_complete(setup())
        ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if self._loop is None:
            self.sock.close()
            return

        async def close():
            if self._session is not None:
                await self._session.close()
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop = None
        self.sock.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        local = request.transport.get_extra_info("sockname") if request.transport else None
        uid = peer_uid(peer, local) if peer and local else None
        if uid != self.uid:
            self.refused += 1
            return web.json_response({"error": "this router front serves only the run's own user"}, status=403)
        if not forwarded(request.method, request.path):
            return web.json_response({"error": f"{request.method} {request.path} is not forwarded: the run's engine "
                                               "fleet owns the router's workers (generation routes and GET only)"},
                                     status=403)
        target = self.router_url()
        if target is None:
            return web.json_response({"error": "no router in service (it is starting or restarting); retry"},
                                     status=503)
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        headers.update(self.headers())
        try:
            async with self._session.request(request.method, target.rstrip("/") + request.path_qs, headers=headers,
                                             data=body) as answer:
                response = web.StreamResponse(status=answer.status, headers={
                    k: v for k, v in answer.headers.items() if k.lower() not in _HOP_HEADERS})
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as e:
            return web.json_response({"error": f"the router at {target} failed: {type(e).__name__}: {e}"},
                                     status=502)

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        """The request's body, or the refusal to send: 413 over `max_body_bytes` (before reading it when the
        Content-Length says so), 408 when it has not all come within `body_timeout_s`."""
        too_large = web.json_response({"error": f"the request body is over the router front's limit of "
                                                f"{self.max_body_bytes} bytes; send less"}, status=413)
        if (request.content_length or 0) > self.max_body_bytes:
            return too_large
        try:
            return await asyncio.wait_for(request.read(), self.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:  # no Content-Length (chunked), and more than the limit came
            return too_large
        except asyncio.TimeoutError:
            return web.json_response({"error": f"the request body did not arrive within {self.body_timeout_s:g} s"},
                                     status=408)
