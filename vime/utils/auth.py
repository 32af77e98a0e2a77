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
environment, so that the programs a process starts (a reward server, a sandboxed program) do not inherit it and
/proc/<pid>/environ (readable by every process of the user, a sandboxed one without Landlock included) does not
show it. The engine servers vime starts read it from a file only this user can read (`write_token_file`), which
their environment names (`CONTROL_TOKEN_FILE_ENV`) and which vime removes once the server has read it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONTROL_TOKEN_FILE_ENV = "VIME_CONTROL_TOKEN_FILE"  # a server's token file: how an engine vime starts receives it
# the token itself, for an engine you start yourself (`token_from_environment`); it is then in that server's
# environment, and its children's: prefer CONTROL_TOKEN_FILE_ENV
CONTROL_TOKEN_ENV = "VIME_CONTROL_TOKEN"
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


def read_token_file(path: str, source: str = "--control-token-file") -> str:
    """The token in `path` (`source` names where the path came from, for the error): a non-empty file that only
    its owner can read."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        text = file.read_text().strip()
    except OSError as e:
        raise ValueError(f"{source} {path}: cannot read it ({e.strerror})") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{source} {path}: readable by other users (mode {stat.S_IMODE(mode):o}); "
                         f"run `chmod 600 {path}`")
    if len(text) < 32:
        raise ValueError(f"{source} {path}: the token must be at least 32 characters (make one with "
                         "`python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return text


def write_token_file(token: RunToken) -> Path:
    """A new file holding `token`, for a server to read (`CONTROL_TOKEN_FILE_ENV`): mode 600 in a fresh 700
    directory, so no other user can read it, or swap it before the server reads it. `remove_token_file` ends it."""
    directory = Path(tempfile.mkdtemp(prefix="vime-token-"))
    path = directory / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token.control)
    return path


def remove_token_file(path: Path) -> None:
    """Remove a `write_token_file` file and its directory (nothing when already gone)."""
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except FileNotFoundError:
        pass


def token_from_environment() -> str | None:
    """In an engine server: the token it was given, from the file `CONTROL_TOKEN_FILE_ENV` names (how vime starts
    its engines; an unreadable or unsafe file raises, so the server does not start unguarded) or else
    `CONTROL_TOKEN_ENV` (an engine you start yourself); None when it was given none."""
    path = os.environ.get(CONTROL_TOKEN_FILE_ENV)
    if path:
        return read_token_file(path, source=CONTROL_TOKEN_FILE_ENV)
    return os.environ.get(CONTROL_TOKEN_ENV) or None
