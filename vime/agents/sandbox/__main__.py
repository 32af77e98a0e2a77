"""`python -m vime.agents.sandbox`: serve a `LocalSandbox` at POST /run for `HTTPSandbox` clients
(`vime.agents.sandbox.service`), on this machine only unless --host exposes it."""

from __future__ import annotations

import argparse

from vime.agents.sandbox.local import LocalSandbox
from vime.agents.sandbox.service import DEFAULT_HOST, DEFAULT_PORT, TOKEN_ENV, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vime.agents.sandbox",
                                     description="Serve a LocalSandbox at POST /run for HTTPSandbox clients "
                                                 f"(--agent-sandbox http://HOST:PORT); the token is ${TOKEN_ENV}.")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="Address to listen on; the default reaches this machine only. Give the address the "
                             "trainer reaches (0.0.0.0: every interface) to expose the service (default: %(default)s).")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="Port (default: %(default)s).")
    parser.add_argument("--allow-weak-isolation", action="store_true",
                        help="Run programs even where namespaces or Landlock are missing (as "
                             "--agent-sandbox-allow-weak-isolation; default: refuse).")
    args = parser.parse_args(argv)
    serve(LocalSandbox(allow_weak_isolation=args.allow_weak_isolation), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
