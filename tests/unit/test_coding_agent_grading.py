"""The coding example's grader: hidden tests import the answer in a program of their own and must print a fresh
nonce after the last assertion, so an answer that exits early (os._exit(0) used to score 1.0) scores 0."""

from __future__ import annotations

import asyncio
import os

import pytest

from examples.coding_agent.grading import grade, grading_files, passed
from vime.agents.sandbox import LocalSandbox, SandboxLimits

pytestmark = pytest.mark.skipif(not os.path.exists("/proc"), reason="LocalSandbox needs Linux")
TESTS = "assert f(0) == 1\nassert f(2) == 7\nassert f(-3) == -8"
RIGHT = "def f(x):\n    return x * 3 + 1"


@pytest.fixture(scope="module")
def sandbox():
    return LocalSandbox(allow_weak_isolation=True)


def _grade(sandbox, code: str) -> tuple[float, dict]:
    return asyncio.run(grade(sandbox, code, TESTS, SandboxLimits(wall_time_s=5)))


@pytest.mark.parametrize("code", [
    RIGHT, RIGHT + "\nprint(f(2), end='')", "import math\n" + RIGHT,
    RIGHT + "\nimport atexit\natexit.register(lambda: print('bye'))",  # output after the nonce is fine
])
def test_a_right_answer_scores_1(sandbox, code):
    score, details = _grade(sandbox, code)
    assert score == 1.0 and details["passed"] and details["exit_code"] == 0, details


@pytest.mark.parametrize("code", [
    "def f(x):\n    return x * 3",  # wrong
    "import os\nos._exit(0)",  # ends the run before any test, with exit code 0
    RIGHT + "\nimport os\nos._exit(0)",  # right, but no test ever ran
    "import sys\nsys.exit(0)",
    "print(open('.nonce').read())\nimport os\nos._exit(0)",  # the nonce is gone before the answer is imported
    "import sys, os\nf = sys._getframe()\nwhile f:\n    [print(v) for v in f.f_locals.values() if isinstance(v, str)]\n"
    "    f = f.f_back\nos._exit(0)",  # nor in any frame
    "class Any:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Any()",  # == always True
])
def test_a_wrong_or_evasive_answer_scores_0(sandbox, code):
    score, details = _grade(sandbox, code)
    assert score == 0.0 and not details["passed"], details


def test_pass_rule():
    nonce = "ab" * 16
    assert passed(f"7\n{nonce}\n", 0, None, nonce)
    assert not passed(f"{nonce}\n", 1, None, nonce) and not passed(f"{nonce}\n", 0, "timeout", nonce)
    assert passed(f"{nonce}\nbye\n", 0, None, nonce) and not passed(f"x{nonce}\n", 0, None, nonce)
    assert not passed("", 0, None, nonce)
    assert grading_files("code", "tests", nonce) == {"solution.py": "code", "tests.py": "tests", ".nonce": nonce}
