"""The coding example's grader: the sandbox computes the values the hidden tests ask about, the grader compares them
outside with expected values that never enter the sandbox, so an answer that exits early, reads every descriptor
(the nonce this grader once hid on fd 3) or prints a forged results line scores 0."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from examples.coding_agent.grading import (RESULTS_PREFIX, encode, grade, grading_files, passed, reported_results,
                                           split_tests)
from vime.agents.sandbox import LocalSandbox, SandboxLimits

pytestmark = pytest.mark.skipif(not os.path.exists("/proc"), reason="LocalSandbox needs Linux")
TESTS = "assert f(0) == 1\nassert f(2) == 7\nassert f(-3) == -8"
RIGHT = "def f(x):\n    return x * 3 + 1"


@pytest.fixture(scope="module")
def sandbox():
    return LocalSandbox(allow_weak_isolation=True)


def _grade(sandbox, code: str, tests: str = TESTS) -> tuple[float, dict]:
    return asyncio.run(grade(sandbox, code, tests, SandboxLimits(wall_time_s=5)))


def _forged_line(values: list) -> str:
    return RESULTS_PREFIX + json.dumps([{"value": encode(v)} for v in values])


@pytest.mark.parametrize("code", [
    RIGHT, RIGHT + "\nprint(f(2), end='')", "import math\n" + RIGHT,
    RIGHT + "\nimport atexit\natexit.register(lambda: print('bye'))",  # output after the results is fine
])
def test_a_right_answer_scores_1(sandbox, code):
    score, details = _grade(sandbox, code)
    assert score == 1.0 and details["passed"] and details["exit_code"] == 0, details


@pytest.mark.parametrize("code", [
    "def f(x):\n    return x * 3",  # wrong
    "import os\nos._exit(0)",  # ends the run before any test, with exit code 0
    RIGHT + "\nimport os\nos._exit(0)",  # right, but no test ever ran
    "import sys\nsys.exit(0)",
    # every descriptor read and printed, then out: there is nothing in the sandbox that could pass for a verdict
    "import os\nfor fd in range(3, 64):\n    try:\n        print(os.read(fd, 64).decode(errors='replace'))\n"
    "    except OSError:\n"
    "        pass\nos._exit(0)",
    "import os\nprint(os.read(3, 64).decode())\nos._exit(0)",  # the old grader's nonce on fd 3 (scored 1.0)
    # a forged results line: it would need the expected values, which never enter the sandbox
    f"import os\nprint({_forged_line([1, 1, 1])!r})\nos._exit(0)",
    f"import atexit\natexit.register(lambda: print({_forged_line([0, 0, 0])!r}))\n" + "def f(x):\n    return 0",
    "import json, os\nprint(open('calls.json').read())\nos._exit(0)",  # the calls are no answers
    "class Any:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Any()",  # == always True
    "class I(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return I(0)",  # an int that lies
    "def f(x):\n    return float(x * 3 + 1)",  # 7.0 is not 7
])
def test_a_wrong_or_evasive_answer_scores_0(sandbox, code):
    score, details = _grade(sandbox, code)
    assert score == 0.0 and not details["passed"], details


def test_tests_the_grader_cannot_judge_outside_are_refused():
    assert split_tests("assert f(0) == 1\nassert -8 == f(-3)\nassert g('a') == ('a', [1.5, None])") == [
        ("f(0)", 1), ("f(-3)", -8), ("g('a')", ("a", [1.5, None]))]
    for bad in ("assert f(0)", "assert f(0) != 1", "assert f(0) == g(1)", "x = 1", "assert 1 < f(0) == 2", ""):
        with pytest.raises(ValueError):
            split_tests(bad)


def test_pass_rule():
    expected = [1, "a", (2, 3.0)]
    good = _forged_line(expected)
    assert passed(f"7\n{good}\n", 0, None, expected) and passed(f"{good}\nbye\n", 0, None, expected)
    assert not passed(f"{good}\n", 1, None, expected) and not passed(f"{good}\n", 0, "timeout", expected)
    assert not passed(f"x{good}\n", 0, None, expected) and not passed("", 0, None, expected)
    assert not passed(_forged_line([1, "a", [2, 3.0]]), 0, None, expected)  # a list is not a tuple
    assert not passed(_forged_line([True, "a", (2, 3.0)]), 0, None, expected)  # True is not 1
    assert not passed(_forged_line(expected[:2]), 0, None, expected)
    assert not passed(RESULTS_PREFIX + '[{"error": "AssertionError"}, 1, null]', 0, None, expected)
    assert passed(f"{_forged_line([0, 0, 0])}\n{good}\n", 0, None, expected)  # the last line counts
    assert reported_results(RESULTS_PREFIX + "{}") is None and reported_results(RESULTS_PREFIX + "[") is None
    assert encode({2: {3}, 1: b"x"}) == encode({1: b"x", 2: {3}})  # order of a dict or set does not matter
    with pytest.raises(TypeError):
        encode(object())
    assert grading_files("code", ["f(0)"]) == {"solution.py": "code", "calls.json": '["f(0)"]'}
