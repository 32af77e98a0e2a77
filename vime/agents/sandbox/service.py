"""A sandbox on another machine: `sandbox_app` serves any Sandbox at POST /run, `HTTPSandbox` is its client.

    # on the sandbox machine (token: a long random secret shared with the trainer, e.g. in VIME_SANDBOX_TOKEN)
    VIME_SANDBOX_TOKEN=... python -m vime.agents.sandbox --host 10.0.0.5 --port 8300
    # or in Python: serve(LocalSandbox(), token=token, max_limits=SandboxLimits(wall_time_s=30), host="10.0.0.5")
    # in the trainer
    HTTPSandbox("http://10.0.0.5:8300", token=token).run(code=...)

It listens on 127.0.0.1 (this machine only) unless `--host` / `host=` names the address to expose it on (the one
the trainer reaches; 0.0.0.0 is every interface): anyone who reaches it can make it run code, token permitting.

The service trusts no client: every request needs `Authorization: Bearer <token>` (401 otherwise, compared in
constant time), and the limits a client asks for are clamped to the service's own `max_limits` (network is
refused with 403 unless the service allows it), so a client cannot ask for an hour of CPU or the network.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os

from vime.agents.sandbox.interface import Sandbox, SandboxLimits, SandboxRefused, SandboxResult
from vime.agents.sandbox.isolation import note_weak_run

TOKEN_ENV = "VIME_SANDBOX_TOKEN"
DEFAULT_HOST = "127.0.0.1"  # this machine only: exposing it is a choice made with --host
DEFAULT_PORT = 8300


def _token(token: str | None, who: str) -> str:
    token = token or os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"{who} needs the sandbox service's token: pass token=... or set {TOKEN_ENV} (the same "
                         "secret on both sides, e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return token


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` (constant time: no timing hints about the token)."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())


class HTTPSandbox(Sandbox):
    """A sandbox service over HTTP: POST {url}/run with {code|command, files, limits} -> SandboxResult JSON."""

    def __init__(self, url: str, token: str | None = None, request_timeout_margin_s: float = 30.0):
        self.url = url.rstrip("/")
        self.token = _token(token, "HTTPSandbox")
        self.margin = request_timeout_margin_s

    async def run(self, code: str | None = None, command: list[str] | str | None = None,
                  files: dict[str, str | bytes] | None = None, limits: SandboxLimits | None = None) -> SandboxResult:
        import aiohttp

        limits = limits or SandboxLimits()
        if any(isinstance(v, bytes) for v in (files or {}).values()):
            raise ValueError("HTTPSandbox sends files as text; decode bytes first")
        payload = {"code": code, "command": command, "files": files or {}, "limits": dataclasses.asdict(limits)}
        timeout = aiohttp.ClientTimeout(total=limits.wall_time_s + self.margin)
        headers = {"Authorization": f"Bearer {self.token}"}
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + "/run", json=payload, timeout=timeout, headers=headers) as r:
                body = await r.json(content_type=None)
                if r.status == 403:
                    raise SandboxRefused(f"sandbox service {self.url}: {body.get('error', body)}")
                if r.status != 200:
                    raise RuntimeError(f"sandbox service {self.url} answered HTTP {r.status}: {body}")
        result = SandboxResult(**body)
        if result.weak_isolation:
            note_weak_run(result.weak_isolation)
        return result


def sandbox_app(sandbox: Sandbox, token: str | None = None, max_limits: SandboxLimits | None = None):
    """An aiohttp application serving `sandbox` at POST /run (what HTTPSandbox talks to).

    token: required from every client (default: VIME_SANDBOX_TOKEN; there is no unauthenticated mode);
    max_limits: the most any request gets (default SandboxLimits(): 10 s, 1 GiB, 32 processes, no network).
    """
    from aiohttp import web

    token = _token(token, "sandbox_app")
    cap = max_limits or SandboxLimits()

    async def run(request: web.Request) -> web.Response:
        if not authorized(request.headers.get("Authorization"), token):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            limits = SandboxLimits.from_dict(body.get("limits")).clamped_to(cap)
            result = await sandbox.run(code=body.get("code"), command=body.get("command"),
                                       files=body.get("files"), limits=limits)
        except SandboxRefused as e:
            return web.json_response({"error": str(e)}, status=403)
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(result.to_dict())

    app = web.Application()
    app.router.add_post("/run", run)
    return app


def serve(sandbox: Sandbox, token: str | None = None, max_limits: SandboxLimits | None = None,
          host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """Serve `sandbox_app(sandbox, token, max_limits)` on host:port until interrupted."""
    from aiohttp import web

    web.run_app(sandbox_app(sandbox, token, max_limits), host=host, port=port)
