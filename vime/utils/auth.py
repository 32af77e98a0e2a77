"""The run's secret: every server route that can change a run answers only to requests that carry it.

Two keys come from one secret (the *control token*):
- the control token itself, which vime's own clients send with control calls (pause, weight updates, worker
  methods, sleep) and which the engines require on every route but /health;
- the *serving key*, derived from it (an HMAC, so holding it reveals nothing of the token), which generation
  requests carry through the router and which the router holds as its `api_key`. The engines accept it only on
  generation routes: vllm-router replaces a caller's credentials with its own key on every control call it
  forwards, so a control call sent through the router is refused by the engine even when the router lets it in.

A process holds its copy in this module, never in its environment, so that the programs it starts (a reward
server, a sandboxed program) do not inherit it; the servers vime starts are given it explicitly. The engine
fleet makes the run's token (or reads --control-token-file) and hands it to its engines.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

CONTROL_TOKEN_ENV = "VIME_CONTROL_TOKEN"  # how a server vime starts receives the token (its environment only)
_SERVING_LABEL = b"vime serving key"
_token: str | None = None


def control_token() -> str:
    """This process's copy of the run's control token, made here (256 random bits) if it has none yet."""
    global _token
    if _token is None:
        _token = secrets.token_hex(32)
    return _token


def use_control_token(token: str) -> None:
    """Adopt the run's token (an actor given it, a process that read --control-token-file)."""
    global _token
    if not token:
        raise ValueError("an empty control token would let anyone in")
    _token = token


def serving_key(token: str | None = None) -> str:
    """The key generation requests carry (through the router) to the engines."""
    return hmac.new((token or control_token()).encode(), _SERVING_LABEL, hashlib.sha256).hexdigest()


def control_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {control_token()}"}


def serving_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {serving_key()}"}


def bearer_matches(authorization: str | None, accepted: tuple[str, ...]) -> bool:
    """Whether an `Authorization: Bearer <key>` header carries one of `accepted`, compared in constant time."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    given_digest = hashlib.sha256(given.strip().encode()).digest()
    match = False
    for key in accepted:  # every key compared, whatever matched first
        match |= hmac.compare_digest(given_digest, hashlib.sha256(key.encode()).digest())
    return match


def read_token_file(path: str) -> str:
    """The token in `path` (--control-token-file): a non-empty file that only its owner can read."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        text = file.read_text().strip()
    except OSError as e:
        raise ValueError(f"--control-token-file {path}: cannot read it ({e.strerror})") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"--control-token-file {path}: readable by other users (mode {stat.S_IMODE(mode):o}); "
                         f"run `chmod 600 {path}`")
    if len(text) < 32:
        raise ValueError(f"--control-token-file {path}: the token must be at least 32 characters (make one with "
                         "`python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return text


def token_from_environment() -> str | None:
    """In a server vime started: the token it was given (`CONTROL_TOKEN_ENV`), None when it was given none."""
    return os.environ.get(CONTROL_TOKEN_ENV) or None
