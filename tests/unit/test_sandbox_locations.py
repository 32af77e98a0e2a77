"""The sandbox wherever the run's files live: the package, the venv and the interpreter beneath directories the jail
hides (/tmp here, as for a clone under /tmp or /home), under the run's umask 077, whatever directory this checkout
is in. Before the fix every run there failed "landlock: Permission denied" on the package's site hooks: binding
them back made the directories on the way 0700 (the umask), root's, and the sandbox's uid could not pass."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vime.agents.sandbox import LocalSandbox
from vime.agents.sandbox.paths import default_python, unreachable_step

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalSandbox needs Linux")

CHILD = r'''
import asyncio, json, sys
from types import SimpleNamespace

import vime
from examples.coding_agent.grading import grade
from vime.agents.sandbox import LocalSandbox, SandboxLimits
from vime.agents.tool_parsing import ToolCall
from vime.agents.tools import TOOLS, ToolContext, run_tool_call


async def main():
    sandbox = LocalSandbox(allow_weak_isolation=True)
    sample = SimpleNamespace(metadata={})
    ctx = ToolContext(sample=sample, sandbox=sandbox, timeout_s=10)
    code = "import sys\nprint(sys.executable)\nprint(sum(range(10)))"
    tool = await run_tool_call(ToolCall(name="python", arguments={"code": code}), {"python": TOOLS["python"]}, ctx)
    score, details = await grade(sandbox, "def f(x):\n    return 2 * x", "assert f(3) == 6",
                                 SandboxLimits(wall_time_s=5))
    print(json.dumps({"package": vime.__file__, "python": sys.executable, "sandbox_python": sandbox.python,
                      "tool": tool, "record": sample.metadata.get("sandbox"), "score": score, "details": details,
                      "isolation": sandbox.isolation}))


asyncio.run(main())
'''


def _hidden_parent() -> str:
    """A directory every masking jail hides (/tmp, else the temp directory), private as a home directory is."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="vime-hidden-home-", dir=base)  # 0700


@pytest.fixture(scope="module")
def hidden_checkout():
    """<hidden>/user (0700) holding a copy of the package and the coding example, and a venv whose interpreter is a
    copy of this one's (so the executable itself lies beneath the hidden directory)."""
    top = _hidden_parent()
    home = Path(top) / "user"
    home.mkdir(mode=0o700)
    checkout = home / "vime"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "vime", checkout / "vime", ignore=ignore)
    shutil.copytree(REPO / "examples" / "coding_agent", checkout / "examples" / "coding_agent", ignore=ignore)
    (checkout / "examples" / "__init__.py").touch()
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--without-pip", str(checkout / ".venv")], check=True,
                   timeout=120)
    try:
        yield checkout
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_python_tool_and_grading_run_from_beneath_hidden_directories(hidden_checkout):
    venv_python = hidden_checkout / ".venv" / "bin" / "python"
    # the run's umask (vime.utils.run_lock.private_umask): everything it creates is 0700 / 0600
    proc = subprocess.run(["sh", "-c", 'umask 077 && exec "$0" -c "$1"', str(venv_python), CHILD],
                          cwd=hidden_checkout, capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(hidden_checkout),
                               "HOME": str(hidden_checkout.parent)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["package"].startswith(str(hidden_checkout))  # the copy beneath the hidden directory ran
    assert out["python"].startswith(str(hidden_checkout))
    # the program ran, with no failure of the sandbox itself, under the venv's interpreter where the uid can run it
    assert "isolation failed" not in out["tool"] and "[stopped" not in out["tool"], out["tool"]
    lines = out["tool"].splitlines()
    assert lines[-1] == "45", out["tool"]
    assert out["record"] == {"tool": {"runs": 1, "errors": 0}}
    assert out["score"] == 1.0 and out["details"]["passed"] and out["details"]["sandbox_error"] is None, out["details"]
    # isolation as from this checkout's own location: nothing weakened to make the hidden location work
    assert out["isolation"] == LocalSandbox(allow_weak_isolation=True).isolation
    if out["isolation"]["hidden"].startswith("empty") or os.geteuid() != 0:
        # masking (or no uid of its own): the interpreter beneath the hidden directories is the one that runs
        assert out["sandbox_python"] == out["python"] and lines[0] == out["python"]


def test_unreachable_step_names_the_directory_that_stops_another_uid(tmp_path):
    prefix = tmp_path / "home" / "user" / "venv"
    (prefix / "bin").mkdir(parents=True)
    python = prefix / "bin" / "python"
    python.write_text("")
    python.chmod(0o755)
    for d in (tmp_path, tmp_path / "home", prefix, prefix / "bin"):
        d.chmod(0o755)
    (tmp_path / "home" / "user").chmod(0o700)
    top = str(tmp_path.parents[len(tmp_path.parents) - 2])  # /tmp: what the jail hides
    assert unreachable_step(str(python)) is not None  # outside the jail <tmp>/home/user (0700) stops another uid
    assert unreachable_step(str(python), hidden=[top]) is None  # inside, the directories above the prefix are its own
    prefix.chmod(0o700)  # what the jail binds back keeps its own modes
    assert unreachable_step(str(python), hidden=[top]) == str(prefix)
    prefix.chmod(0o755)
    python.chmod(0o700)
    assert unreachable_step(str(python), hidden=[top]) == str(python)
    python.chmod(0o755)
    (tmp_path / "home" / "user").chmod(0o755)
    tmp_path.chmod(0o755)
    ancestors_open = all(os.stat(d).st_mode & 0o001 for d in tmp_path.parents)
    assert (unreachable_step(str(python)) is None) == ancestors_open


def test_default_python_as_root_takes_this_one_only_where_the_sandbox_uid_can_run_it(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "private" / "bin" / "python"))
    (tmp_path / "private" / "bin").mkdir(parents=True)
    Path(sys.executable).write_text("")
    Path(sys.executable).chmod(0o755)
    (tmp_path / "private").chmod(0o700)
    assert default_python(is_root=False) == sys.executable  # the sandbox runs as this user: always reachable
    chosen = None
    try:
        chosen = default_python(is_root=True)
    except RuntimeError as e:
        assert "chmod o+x" in str(e) and str(tmp_path / "private") in str(e)
    assert chosen != sys.executable
