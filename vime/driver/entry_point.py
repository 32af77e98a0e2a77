"""The life of a run's process around its loop (train.py, train_async.py): flags parsed, a private umask before
anything starts, Ray shut down whatever happens, a bad flag answered as usage, and an exit that skips the
interpreter's slow teardown of native modules.
"""

from __future__ import annotations

import logging
import os
import sys

from vime.arguments import ArgumentsError, build_parser
from vime.config.run import JobConfig
from vime.driver.placement import shutdown_ray
from vime.utils.run_lock import RunInUseError, private_umask


def run_entry_point(train_fn, argv: list[str] | None = None) -> None:
    """Parse flags, run `train_fn(args)`, and always shut Ray down (what train.py and train_async.py do)."""
    from vime.arguments import parse_args
    from vime.utils.logging_utils import configure_logging

    configure_logging()
    private_umask()  # before Ray and the servers start: everything the run writes is its user's alone
    args = parse_args(argv, check_model=False)  # the session checks the model while Ray starts
    job = JobConfig.of(args)
    try:
        train_fn(args)
    except ArgumentsError as e:  # as any other bad flag: usage, the message, exit code 2
        build_parser().error(str(e))
    except RunInUseError as e:
        logging.getLogger("vime").error("%s", e)
        sys.exit(1)
    finally:
        shutdown_ray()
    logging.getLogger("vime").info("done: metrics in %s/metrics.jsonl", job.output_dir)


def exit_after_run() -> None:
    """End a finished run's process at once. Everything it wrote is closed by now (metrics, checkpoints, the
    transport; Ray is shut down); what remains is the interpreter tearing down torch, vLLM and Ray's native
    modules, about 2 s a run, and their destructors have crashed at exit before (see tests/conftest.py)."""
    if "wandb" in sys.modules:  # its service process stops in an exit hook that os._exit would skip
        sys.modules["wandb"].teardown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def engine_idle_fraction(metrics: dict, step_time: float) -> float:
    """The share of a loop step the engines spent not generating: each step collects one rollout, generated within
    the step (train.py) or back to back beside the steps (train_async.py), so its generation time is the engines'
    busy time of a step; a rollout replayed from storage kept them idle."""
    busy = 0.0 if metrics.get("buffer/replayed") else metrics.get("rollout/time", 0.0)
    return min(1.0, max(0.0, 1.0 - busy / step_time)) if step_time > 0 else 0.0
