"""A run that stops before a chosen rollout until the test lets it go, for the crash tests.

`--rollout-function-path crash_hold_plugin.generate_rollout` (with `held_run_env`) is vime's default rollout,
except that rollout VIME_TEST_HOLD_AT first touches `<VIME_TEST_HOLD>.reached`, then waits while the file
VIME_TEST_HOLD exists. VIME_TEST_HOLD_AT may list several rollouts ("1,3"): each after the first has its own
hold file, `hold_file(hold, rollout_id)`. A test that kills the run while it waits knows exactly what the run has done: a step of the
tiny run takes under a second, too short to aim a kill at from outside by watching its files.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

HOLD_ENV, HOLD_AT_ENV = "VIME_TEST_HOLD", "VIME_TEST_HOLD_AT"
FUNCTION_PATH = "crash_hold_plugin.generate_rollout"
HERE = Path(__file__).resolve().parent


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    from vime.rollout.vllm_rollout import generate_rollout as default_rollout

    hold = os.environ.get(HOLD_ENV)
    at = [int(r) for r in os.environ.get(HOLD_AT_ENV, "").split(",") if r]
    if hold and not evaluation and rollout_id in at:
        hold = str(hold_file(Path(hold), rollout_id, at[0]))
        Path(f"{hold}.reached").touch()
        deadline = time.monotonic() + 600
        while os.path.exists(hold):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout {rollout_id} held for 10 minutes: the test never removed {hold}")
            time.sleep(0.05)
    return default_rollout(args, rollout_id, data_source, evaluation=evaluation)


def hold_file(hold: Path, rollout_id: int, first: int) -> Path:
    """The file rollout `rollout_id` waits on: `hold` for the first held rollout, `<hold>.<id>` for the others."""
    return hold if rollout_id == first else Path(f"{hold}.{rollout_id}")


def held_run_env(hold: Path | None = None, at: int | tuple[int, ...] | None = None) -> dict[str, str]:
    """The environment of a train.py run that can import this plugin; with `hold`, rollout `at` (or each of
    several) waits while its file (`hold_file`, created here) exists."""
    repo = HERE.parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(repo), os.environ.get("PYTHONPATH", "")])}
    env.pop(HOLD_ENV, None)
    if hold is not None:
        ids = (at,) if isinstance(at, int) else tuple(at)
        for rollout_id in ids:
            hold_file(hold, rollout_id, ids[0]).touch()
        env.update({HOLD_ENV: str(hold), HOLD_AT_ENV: ",".join(map(str, ids))})
    return env


def wait_until_held(proc: subprocess.Popen, hold: Path, log_tail=lambda: "") -> None:
    """Until the run `proc` waits at its held rollout (fails if it ends first, or after 5 minutes)."""
    reached = Path(f"{hold}.reached")
    deadline = time.monotonic() + 300
    while not reached.exists():
        assert proc.poll() is None, log_tail()
        assert time.monotonic() < deadline, f"the run did not reach its held rollout within 5 minutes ({hold})"
        time.sleep(0.1)


def never_returns(args, rollout_id, data_source, evaluation=False):
    """A rollout function that hangs (the --rollout-timeout test): the run must stop by itself, naming it."""
    while True:
        time.sleep(1)
