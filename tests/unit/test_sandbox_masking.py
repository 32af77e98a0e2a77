"""Which shared directories a sandbox hides behind an empty tmpfs, and what it binds back beneath them."""

from __future__ import annotations

import os

from vime.agents.sandbox import masking


def test_plan_hides_outermost_existing_directories_and_keeps_the_runs_paths(tmp_path):
    for d in ("tmp/run-1/work", "home/u/venv", "home/v", "run/user/0", "shm"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "var").mkdir()
    os.symlink(tmp_path / "run", tmp_path / "var" / "run")
    t = str(tmp_path)
    steps = masking.plan([f"{t}/tmp", f"{t}/home", f"{t}/home/v", f"{t}/run", f"{t}/var/run", f"{t}/shm",
                          f"{t}/missing"],
                         keep=[f"{t}/tmp/run-1", f"{t}/home/u/venv", f"{t}/shm", f"{t}/missing-kept"])
    assert steps == [(f"{t}/home", [f"{t}/home/u/venv"]), (f"{t}/run", []), (f"{t}/tmp", [f"{t}/tmp/run-1"])]


def test_beneath_is_by_path_component():
    assert masking.beneath("/tmp/x", "/tmp") and masking.beneath("/tmp", "/tmp")
    assert not masking.beneath("/tmpfoo", "/tmp") and not masking.beneath("/", "/tmp")
