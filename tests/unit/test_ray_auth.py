"""The run's Ray cluster asks for a token only the run has: a 0600 file in a 0700 directory, never
~/.ray/auth_token; another user (uid 65534) is refused by its GCS, the run's own workers get in; the token goes
with the run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv for a second user")

PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", namespace=None, timeout=5)
    print("IN")
except Exception as e:
    print("REFUSED", type(e).__name__)
"""


@pytest.fixture()
def no_ray_auth_settings():
    """This process without RAY_AUTH_* settings, and after the test with the ones it had, as Ray sees them (Ray
    caches its authentication config per process: restoring the environment alone would leave them apart)."""
    from vime.driver.ray_auth import MODE_ENV, TOKEN_PATH_ENV, reload_ray_auth_config

    names = (MODE_ENV, TOKEN_PATH_ENV, "RAY_AUTH_TOKEN")
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    reload_ray_auth_config()
    yield
    for name in names:
        os.environ.pop(name, None)
    os.environ.update(saved)
    reload_ray_auth_config()


def test_the_runs_cluster_admits_only_the_runs_token(no_ray_auth_settings):
    import ray

    from tests.helpers.run_sections import init_ray_of
    from vime.driver.placement import shutdown_ray
    from vime.driver.ray_auth import MODE_ENV, TOKEN_PATH_ENV

    home_token = os.path.expanduser("~/.ray/auth_token")
    before = os.stat(home_token).st_mtime if os.path.exists(home_token) else None
    if ray.is_initialized():
        ray.shutdown()
    init_ray_of(SimpleNamespace(ray_address=None, rollout_num_gpus=1, actor_num_nodes=1, actor_num_gpus_per_node=1,
                                judge_checkpoint=None, judge_num_engines=1))
    try:
        path = os.environ[TOKEN_PATH_ENV]
        assert os.environ[MODE_ENV] == "token"
        assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        gcs = ray.get_runtime_context().gcs_address

        def probe(env: dict, as_other: bool) -> str:
            prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_other else []
            out = subprocess.run([*prefix, sys.executable, "-c", PROBE, gcs], capture_output=True, text=True,
                                 env={"PATH": os.environ["PATH"], "HOME": "/tmp", **env}, timeout=120)
            lines = out.stdout.strip().splitlines()
            return lines[-1] if lines else f"exit {out.returncode}: {out.stderr.strip()[-300:]}"

        assert probe({}, as_other=True) == "REFUSED AuthenticationError"
        # the run's token file cannot be read by them: their Ray client aborts before it connects
        assert probe({MODE_ENV: "token", TOKEN_PATH_ENV: path}, as_other=True) != "IN"
        assert ray.get(ray.remote(lambda: "IN").remote()) == "IN"  # the run's own workers are in
    finally:
        shutdown_ray()
    assert not os.path.exists(path) and TOKEN_PATH_ENV not in os.environ
    assert (os.stat(home_token).st_mtime if os.path.exists(home_token) else None) == before


def test_a_token_this_process_did_not_make_stays(no_ray_auth_settings, tmp_path):
    """A run started by another vime process inherits its token in the environment: stopping it leaves the
    parent's token (and the environment naming it) alone."""
    from vime.driver.ray_auth import MODE_ENV, TOKEN_PATH_ENV, drop_run_token

    parents = tmp_path / f"vime-ray-auth-{os.getpid() + 1}-abc"
    parents.mkdir()
    (parents / "auth_token").write_text("0" * 64)
    os.environ[MODE_ENV], os.environ[TOKEN_PATH_ENV] = "token", str(parents / "auth_token")
    drop_run_token()
    assert (parents / "auth_token").exists() and os.environ[TOKEN_PATH_ENV] == str(parents / "auth_token")


def test_a_killed_runs_token_directory_is_reaped(tmp_path):
    """A run killed with SIGKILL leaves its token directory; the next run removes those whose lock no process
    holds any more, never a live run's (its lock is held, whatever pid namespace it is in) nor a directory
    without a lock file."""
    from vime.driver.ray_auth import LOCK_FILE, reap_dead_runs_tokens

    holder = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
              "print('held', flush=True)\ntime.sleep(60)\n")
    dirs = {name: tmp_path / name for name in ("vime-ray-auth-1-dead", "vime-ray-auth-2-live",
                                               "vime-ray-auth-3-nolock", "unrelated")}
    for name, d in dirs.items():
        d.mkdir()
        (d / "auth_token").write_text("0" * 64)
        if name != "vime-ray-auth-3-nolock":
            (d / LOCK_FILE).touch()
    live = subprocess.Popen([sys.executable, "-c", holder, str(dirs["vime-ray-auth-2-live"] / LOCK_FILE)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "held"
        dead = subprocess.run([sys.executable, "-c", holder.replace("time.sleep(60)", "os._exit(0)"),
                               str(dirs["vime-ray-auth-1-dead"] / LOCK_FILE)], capture_output=True, timeout=60)
        assert dead.returncode == 0
        assert reap_dead_runs_tokens(str(tmp_path)) == [str(dirs["vime-ray-auth-1-dead"])]
        assert [d.exists() for d in dirs.values()] == [False, True, True, True]
    finally:
        live.kill()
        live.wait()
    assert reap_dead_runs_tokens(str(tmp_path)) == [str(dirs["vime-ray-auth-2-live"])]  # once its holder died
