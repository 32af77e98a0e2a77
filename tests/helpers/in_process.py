"""train.py and train_async.py run inside the test process, through the same `train(args)` a subprocess runs, on one
local Ray cluster the tests of a directory share: no interpreter start, imports, Ray start and Ray stop per run (about
6 s of a tiny run's 17 here). What only a process can show (a crash, SIGKILL and resume, exit codes, flag errors
on stderr, the README commands) keeps its subprocess.

    run_train([sys.executable, "train.py", *flags])    # raises what the run raised

A run must leave nothing on the shared cluster (`TrainingSession.__exit__` kills its actors and releases its
placement group): `run_train` checks the cluster's CPUs are all free again after each run.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENTRIES = {"train.py": "train", "train_async.py": "train_async"}
CLUSTER_CPUS = 16  # logical: enough slots for any e2e layout (ranks + engines + judges + the manager)
_PLUGINS = Path(tempfile.gettempdir()) / f"vime-test-plugins-{os.getpid()}"  # this test process's


def plugin_dir() -> Path:
    """A directory on the shared cluster's import path and this process's (the run checks its function paths here),
    for a test's own plugin modules (a unique name each)."""
    _PLUGINS.mkdir(mode=0o700, exist_ok=True)
    if str(_PLUGINS) not in sys.path:
        sys.path.append(str(_PLUGINS))
    return _PLUGINS


def shared_cluster() -> None:
    """Start the package's Ray cluster unless one is up (`vime.ray.placement.start_local_ray`: the run's own path).
    Its workers import from the repository, tests/e2e (the test plugins) and `plugin_dir()`, as a run's subprocess
    given that PYTHONPATH would: a worker takes the environment the cluster started with, not a run's."""
    import ray

    from vime.ray.placement import start_local_ray

    if not ray.is_initialized():
        saved = os.environ.get("PYTHONPATH")
        paths = [str(REPO), str(REPO / "tests" / "e2e"), str(plugin_dir()), saved or ""]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        try:
            start_local_ray(CLUSTER_CPUS)
        finally:  # the cluster's processes have it; the tests' own subprocesses get what they set
            if saved is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = saved


def stop_shared_cluster() -> None:
    import ray

    from vime.ray.placement import shutdown_ray

    if ray.is_initialized():
        shutdown_ray()
    shutil.rmtree(_PLUGINS, ignore_errors=True)


def run_train(cmd: list[str]) -> None:
    """Run `cmd` ([python, <path>/train.py | train_async.py, *flags]) in this process."""
    import ray

    from vime.arguments import parse_args

    entry = Path(cmd[1]).name
    if entry not in ENTRIES:
        raise ValueError(f"{cmd[1]} is not train.py or train_async.py")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    module = importlib.import_module(ENTRIES[entry])
    shared_cluster()
    args = parse_args(list(cmd[2:]), check_model=False)
    start = time.perf_counter()
    try:
        module.train(args)
    finally:
        logging.getLogger(__name__).info("%s ran in process in %.1f s", entry, time.perf_counter() - start)
        _check_released(ray)


def _check_released(ray, timeout: float = 30.0) -> None:
    """Every logical CPU of the shared cluster is free again: the run's actors and placement group are gone."""
    deadline = time.monotonic() + timeout
    while True:
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
        if free >= total:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the run left {total - free:g} of the cluster's {total:g} CPUs taken")
        time.sleep(0.2)

