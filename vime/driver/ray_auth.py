"""Ray's own authentication for the clusters a run starts and joins.

Ray 2.60 turns token authentication on for a new local cluster and writes the token to ~/.ray/auth_token with the
process's umask (0644 on most machines): whoever reads it can submit code that runs as the user. A cluster vime
starts gets a token of its own instead, made for the run in a 0700 directory as a 0600 file and named to Ray by
RAY_AUTH_TOKEN_PATH (its processes inherit it); the directory goes when the run ends. Joining a cluster
(--ray-address) that does not ask for a token is allowed with a warning naming it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import tempfile

logger = logging.getLogger(__name__)

MODE_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"
PREFIX = "vime-ray-auth-"  # then the pid of the process that made it
LOCK_FILE = "lock"
_held_locks: dict[str, int] = {}  # token directory -> the fd of its lock, held until `drop_run_token`


def use_run_token() -> str | None:
    """Before a local `ray.init`: a fresh token for this run's cluster; returns the private directory holding it
    (`drop_run_token` removes it), or None where the user chose Ray's authentication themselves (RAY_AUTH_MODE or
    a token path set)."""
    if os.environ.get(MODE_ENV) or os.environ.get(TOKEN_PATH_ENV) or os.environ.get("RAY_AUTH_TOKEN"):
        if os.environ.get(MODE_ENV, "").lower() == "disabled":
            logger.warning("RAY_AUTH_MODE=disabled: this run's Ray cluster accepts anyone who can reach it")
        return None
    reap_dead_runs_tokens(tempfile.gettempdir())
    directory = tempfile.mkdtemp(prefix=_owned_prefix())  # 0700
    lock = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held while this process lives (`reap_dead_runs_tokens`)
    _held_locks[directory] = lock
    path = os.path.join(directory, "auth_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ[MODE_ENV], os.environ[TOKEN_PATH_ENV] = "token", path
    reload_ray_auth_config()
    return directory


def reap_dead_runs_tokens(root: str) -> list[str]:
    """Remove the token directories under `root` that this user's runs made and could not remove (a run killed
    with SIGKILL). A run holds an flock on its directory's lock file while it lives, which the kernel releases
    when it dies: a directory whose lock can be taken is an orphan, whatever pid namespace its run was in; one
    without a lock file is left alone. Returns what it removed."""
    removed = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if not name.startswith(PREFIX) or os.lstat(path).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its run still holds it
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def reload_ray_auth_config() -> None:
    """Ray reads the mode and the token once per process, at import: make this process see the new ones (what
    Ray's own `ray get-auth-token` path does)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _owned_prefix() -> str:
    """Token directories this process made carry its pid: a child that inherited the environment (a run started
    by a test, say) uses the parent's token and never removes it."""
    return f"{PREFIX}{os.getpid()}-"


def drop_run_token() -> None:
    """After `ray.shutdown`: the token directory this process made for its cluster (named by RAY_AUTH_TOKEN_PATH)
    goes, and with it the environment that named it; a token set by anyone else stays."""
    path = os.environ.get(TOKEN_PATH_ENV, "")
    directory = os.path.dirname(path)
    if not os.path.basename(directory).startswith(_owned_prefix()):
        return
    shutil.rmtree(directory, ignore_errors=True)
    lock = _held_locks.pop(directory, None)
    if lock is not None:
        os.close(lock)
    os.environ.pop(TOKEN_PATH_ENV, None)
    os.environ.pop(MODE_ENV, None)
    reload_ray_auth_config()


def warn_if_unauthenticated(address: str) -> bool:
    """After joining the cluster at `address`: warn (True) when this connection uses no token, i.e. the cluster
    accepts anyone who can reach it."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    if get_authentication_mode() == AuthenticationMode.TOKEN:
        return False
    logger.warning("the Ray cluster at --ray-address %s does not ask for a token: anyone who can reach it can run "
                   "code as you and read the run's data. Start it with RAY_AUTH_MODE=token (and the token in a 0600 "
                   "file named by RAY_AUTH_TOKEN_PATH) and give this run the same", address)
    return True
