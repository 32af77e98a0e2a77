"""The run's secret: every server route that can change a run answers only to requests that carry it.

Two keys come from one secret (the *control token*):
- the control token itself, which vime's own clients send with control calls (pause, weight updates, worker
  methods, sleep) and which the engines require on every route but /health;
- the *serving key*, derived from it (an HMAC, so holding it reveals nothing of the token), which generation
  requests carry through the router and which the router holds as its `api_key`. The engines accept it only on
  generation routes: vllm-router replaces a caller's credentials with its own key on every control call it
  forwards, so a control call sent through the router is refused by the engine even when the router lets it in.

The secret is a `RunToken` value that its owners hold and pass on: the engine fleet and the rollout context of the
rollout manager (which makes it, or reads --control-token-file), each engine actor, the router handle, the judge.
Nothing looks it up: two runs in one process (tests) each send their own. It is never in a process's argv or
environment, so that the programs a process starts (a reward server, a sandboxed program) do not inherit it; the
servers vime starts are given it explicitly, in their own environment only (`CONTROL_TOKEN_ENV`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

CONTROL_TOKEN_ENV = "VIME_CONTROL_TOKEN"  # how a server vime starts receives the token (its environment only)
_SERVING_LABEL = b"vime serving key"


@dataclass(frozen=True)
class RunToken:
    """The run's control token and the keys made from it. Immutable, so a holder can hand it on without
    copying; its repr hides the secret (it shows up in logs, tracebacks and Ray's task descriptions)."""

    control: str

    def __post_init__(self):
        if not self.control:
            raise ValueError("an empty control token would let anyone in")

    @classmethod
    def new(cls) -> RunToken:
        """A fresh token: 256 random bits."""
        return cls(secrets.token_hex(32))

    @classmethod
    def read(cls, path: str) -> RunToken:
        """The token in `path` (--control-token-file), checked by `read_token_file`."""
        return cls(read_token_file(path))

    def __repr__(self) -> str:
        return "RunToken(<secret>)"

    def serving_key(self) -> str:
        return serving_key(self.control)

    def control_headers(self) -> dict[str, str]:
        """What control calls to the engines carry."""
        return {"Authorization": f"Bearer {self.control}"}

    def serving_headers(self) -> dict[str, str]:
        """What generation requests and calls to the router carry."""
        return {"Authorization": f"Bearer {self.serving_key()}"}


def serving_key(token: str) -> str:
    """The key generation requests carry (through the router) to the engines, made from control token `token`."""
    return hmac.new(token.encode(), _SERVING_LABEL, hashlib.sha256).hexdigest()


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
