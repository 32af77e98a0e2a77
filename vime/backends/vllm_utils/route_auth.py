"""Which key each route of a vime engine's HTTP server asks for, and the ASGI middleware that asks.

vLLM's server with VLLM_SERVER_DEV_MODE=1 exposes routes that run code in the engine (/collective_rpc, vime's
/vime/update_weights), load other weights, pause or put it to sleep; its own --api-key guards only the /v1,
/v2 and /inference paths. vime's endpoint plugin (`endpoint.py`) puts this middleware in front of every route:
- /health: open (the router's and vime's health probes);
- generation routes, an explicit list (`SERVING_PATHS`: completions, chat, responses, messages, generate, the
  renderers, tokenize, the model list, pooling): the serving key or the control token (`vime.utils.auth`);
- every other route (control, profiling, /metrics, /docs, /inference/v1/abort_requests, the LoRA adapter loaders,
  and any route a later vLLM adds): the control token only. A route matched by prefix would have opened the next
  vLLM's new routes (and its abort route) to the serving key.
"""

from __future__ import annotations

import json

from vime.utils.auth import bearer_matches

PUBLIC_PATHS = frozenset({"/health"})
# what generation needs (vime's rollouts, agents' OpenAI / Anthropic calls, teacher scoring) and reads nothing else
SERVING_PATHS = frozenset({
    "/inference/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/completions/render", "/v1/chat/completions/render", "/v1/responses/render",
    "/v1/messages/render", "/v1/models", "/tokenize", "/detokenize", "/v1/embeddings", "/pooling", "/classify",
    "/score", "/rerank", "/v1/score", "/v1/rerank", "/v2/embed", "/v2/rerank",
})


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
