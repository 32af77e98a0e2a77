"""The server vime starts for `--environment openenv:<app module>`: the OpenEnv app behind a per-server token.

    python -m vime.environments.openenv_server pkg.server.app:app --host 127.0.0.1 --port 8123  (token on stdin)

An OpenEnv app (`create_app(...)`) answers anyone who reaches its port: another user on the node could open
WebSocket sessions and step actions in a process of the trainer's user. This program serves the app (uvicorn, as
`uvicorn module:app` would) behind `RequireToken`: every HTTP request and WebSocket handshake, /health included,
must carry `Authorization: Bearer <token>`. The token arrives on standard input (never argv, which every user can
read, nor the environment, which the app's children would inherit); `openenv_env.OpenEnvServer` sends it only
after checking that the port's listener is this process.
"""

from __future__ import annotations

import argparse
import json
import sys

from vime.utils.auth import bearer_matches

REFUSED = json.dumps({"error": "this OpenEnv server answers only the vime run that started it "
                               "(Authorization: Bearer <its token>)"}).encode()


class RequireToken:
    """ASGI middleware: a request or WebSocket handshake without the token gets 401 (a WebSocket: closed before it is
    accepted, which uvicorn answers with 403); lifespan events pass."""

    def __init__(self, app, token: str):
        if not token:
            raise ValueError("an empty token would let anyone in")
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or bearer_matches(_authorization(scope), (self.token,)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(REFUSED)).encode())]})
        await send({"type": "http.response.body", "body": REFUSED})


def _authorization(scope) -> str | None:
    return next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("app", help="the OpenEnv app, module:attribute")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    options = parser.parse_args()
    token = sys.stdin.readline().strip()
    if not token:
        raise SystemExit("vime.environments.openenv_server reads its token on standard input, and got none: it is "
                         "started by `--environment openenv:<module>`, not by hand")
    import uvicorn
    from uvicorn.importer import import_from_string

    app = import_from_string(options.app)
    uvicorn.run(RequireToken(app, token), host=options.host, port=options.port, log_level="warning")


if __name__ == "__main__":
    main()
