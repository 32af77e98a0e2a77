"""Which key each route of a vime engine's HTTP server asks for, and the ASGI middleware that asks.

vLLM's server with VLLM_SERVER_DEV_MODE=1 exposes routes that run code in the engine (/collective_rpc, vime's
/vime/update_weights), load other weights, pause or put it to sleep; its own --api-key guards only the /v1,
/v2 and /inference paths. vime's endpoint plugin (`endpoint_plugin.py`) puts this middleware in front of every
route (the lists: `vime.engine.protocol.names`, which the router gate reads too):
- /health: open (the router's and vime's health probes);
- generation routes, an explicit list (`SERVING_PATHS`: completions, chat, responses, messages, generate, the
  renderers, tokenize, the model list, pooling): the serving key or the control token (`vime.utils.auth`);
- every other route (control, profiling, /metrics, /docs, /inference/v1/abort_requests, the LoRA adapter loaders,
  and any route a later vLLM adds): the control token only. A route matched by prefix would have opened the next
  vLLM's new routes (and its abort route) to the serving key.
"""

from __future__ import annotations

import json

from vime.engine.protocol.names import PUBLIC_PATHS, SERVING_PATHS
from vime.utils.auth import bearer_matches


def accepted_keys(path: str, control_token: str, serving_key: str) -> tuple[str, ...]:
    """The keys that open `path`; () when the route is open to anyone."""
    if path in PUBLIC_PATHS:
        return ()
    if path in SERVING_PATHS:
        return (control_token, serving_key)
    return (control_token,)


class RunTokenMiddleware:
    """Answers 401 to a request without a key that opens its route (`accepted_keys`)."""

    def __init__(self, app, control_token: str, serving_key: str):
        self.app = app
        self.control_token, self.serving_key = control_token, serving_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan events
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        keys = accepted_keys(path, self.control_token, self.serving_key)
        authorization = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"),
                             None)
        if not keys or bearer_matches(authorization, keys):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": f"{path} needs the run's control token (Authorization: Bearer ...)"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
