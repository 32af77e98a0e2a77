"""Processes for tests that start many short ones (training ranks, restarts): forked from one server process that
imported torch, Megatron-core and vime's trainer once, instead of each interpreter importing them again (~10 s of
a core apiece on a slow 2-core machine, most of such a process's life).

A child is a fresh process as far as a test can tell (its own pid, process group and environment), forked before
anything in the server ran torch code: no threads, no process group, no OpenMP pool yet. Python's `random` is
reseeded at the fork; torch's and numpy's generators start as the server's, so a child seeds them itself (the
trainer does: `init_parallel`). It starts in `cwd` with `env` (the server's own environment is the pytest
process's at the server's start) and writes stdout and stderr to `log`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

PRELOAD = ["torch", "megatron.core", "vime.arguments", "vime.trainer.trainer", "vime.trainer.megatron.parallel",
           "vime.trainer.megatron.hf_checkpoint"]


def start(target: Callable, args: tuple, log: Path, env: dict[str, str], cwd: Path) -> multiprocessing.Process:
    """Start `target(*args)` in a child of the warm server; `.exitcode` is its exit status once it ends."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call in this process
    process = context.Process(target=_run, args=(target, args, str(log), env, str(cwd)), daemon=False)
    process.start()
    return process


def wait_for_all(procs: list[multiprocessing.Process], timeout_s: float, expect_exit: int | None = None) -> int | None:
    """Wait until every process of `procs` (one job's ranks) has ended; the index of the first that failed (exited
    with neither 0 nor `expect_exit`, or, once all ended, other than `expect_exit` when that is given), else None.
    A rank that fails leaves the others waiting in a collective: they are killed at the first failure, and all of
    them past `timeout_s` (TimeoutError)."""
    deadline, failed = time.monotonic() + timeout_s, None
    try:
        while failed is None and any(p.exitcode is None for p in procs):
            failed = next((rank for rank, p in enumerate(procs) if p.exitcode and p.exitcode != expect_exit), None)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(procs)} processes did not finish within {timeout_s} s")
            time.sleep(0.2)
        if failed is None:
            failed = next((rank for rank, p in enumerate(procs) if p.exitcode != (expect_exit or 0)), None)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    return failed


def _run(target: Callable, args: tuple, log: str, env: dict[str, str], cwd: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    target(*args)  # multiprocessing prints what it raises, exits 1 (or SystemExit's code) and flushes the streams


def run_script(path: Path, argv: list[str], log: Path, env: dict[str, str], cwd: Path, timeout_s: float) -> int:
    """Run the script `path` as `python path argv...` would (its `__main__` block, `sys.argv`), in a warm child;
    its exit status (killed past `timeout_s`)."""
    process = start(_script, (str(path), argv), log, env, cwd)
    process.join(timeout_s)
    if process.exitcode is None:
        process.kill()
        process.join()
    return process.exitcode


def _script(path: str, argv: list[str]) -> None:
    import runpy

    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")
