"""Grading a final answer: the sandbox only computes the values the hidden tests ask about; the grader, outside
the sandbox, compares them with the expected values, which never enter the sandbox.

    score, details = await grade(sandbox, code="def f(x):\\n    return x + 1", tests="assert f(1) == 2")

Hidden tests are lines `assert EXPR == LITERAL` (LITERAL: anything `ast.literal_eval` reads). The sandbox runs a
fixed program (RUNNER) beside `solution.py` (the model's code) and `calls.json` (the EXPRs only): it imports the
solution, evaluates each EXPR and prints one line, RESULTS_PREFIX + JSON, of the values in a tagged encoding
(`encode`: the type is part of the value, so 1, 1.0 and True differ and an object whose `__eq__` always answers
True is no value at all). The grader encodes each LITERAL the same way and compares the two, here.
Why: whatever runs in the sandbox shares a process with the solution, which can read every descriptor and frame
there (the nonce this grader once hid on fd 3 was one `os.read(3, 64)` away) and write anything to stdout. So
nothing in the sandbox may decide the verdict: a forged results line must hold the right values, which only a right
answer (or one that hard-codes the tested inputs, as any test-based grader admits) can know. An answer that exits
early prints no results line and scores 0; the run must also end by itself with exit code 0.
"""

from __future__ import annotations

import ast
import inspect
import json
from typing import Any

from vime.agents.sandbox import Sandbox, SandboxLimits

RESULTS_PREFIX = "VIME-GRADING-RESULTS "


def encode(value: Any, depth: int = 0) -> list:
    """A JSON form of `value` that keeps its exact type (no subclasses: they can redefine ==). Raises TypeError for
    anything else. The same function runs in the sandbox (on the answer's values) and here (on the expected ones)."""
    if depth > 50:
        raise TypeError("nested too deep")
    kind = type(value)
    if value is None:
        return ["None"]
    if kind in (bool, str):
        return [kind.__name__, value]
    if kind in (int, float, complex):
        return [kind.__name__, repr(value)]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple):
        return [kind.__name__, [encode(v, depth + 1) for v in value]]
    if kind in (set, frozenset):
        return [kind.__name__, sorted((encode(v, depth + 1) for v in value), key=json.dumps)]
    if kind is dict:
        items = [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]
        return ["dict", sorted(items, key=json.dumps)]
    raise TypeError(f"a value of type {kind.__name__} cannot be graded")


RUNNER = "from __future__ import annotations\nimport json\n\n\n" + inspect.getsource(encode) + r'''

def main():
    import os
    import sys

    with open("calls.json") as f:
        calls = json.load(f)
    os.unlink("calls.json")
    sys.path.insert(0, os.getcwd())
    namespace = {"__name__": "hidden_tests"}
    exec("from solution import *", namespace)
    results = []
    for call in calls:
        try:
            results.append({"value": encode(eval(call, namespace))})
        except BaseException as e:  # a failed test, not a failed grading
            results.append({"error": type(e).__name__})
    sys.stdout.flush()
    sys.stdout.write("\n" + PREFIX + json.dumps(results) + "\n")
    sys.stdout.flush()


PREFIX = %r
main()
''' % RESULTS_PREFIX


def split_tests(tests: str) -> list[tuple[str, Any]]:
    """[(EXPR source, expected value)] from lines `assert EXPR == LITERAL` (or `LITERAL == EXPR`); ValueError for
    any other statement: the grader judges only what it can compare outside the sandbox."""
    cases = []
    for node in ast.parse(tests).body:
        compare = node.test if isinstance(node, ast.Assert) else None
        if not (isinstance(compare, ast.Compare) and len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq)):
            raise ValueError(f"hidden test line {node.lineno} is not `assert EXPR == LITERAL`: "
                             f"{ast.get_source_segment(tests, node)!r}")
        left, right = compare.left, compare.comparators[0]
        for expr, literal in ((left, right), (right, left)):
            try:
                expected = ast.literal_eval(literal)
            except ValueError:
                continue
            cases.append((ast.unparse(expr), expected))
            break
        else:
            raise ValueError(f"hidden test line {node.lineno} compares with no literal: "
                             f"{ast.get_source_segment(tests, node)!r}")
    if not cases:
        raise ValueError("no hidden tests")
    return cases


def grading_files(code: str, calls: list[str]) -> dict[str, str]:
    return {"solution.py": code, "calls.json": json.dumps(calls)}


def reported_results(stdout: str) -> list | None:
    """The last results line the sandbox printed, or None (none, or not a list)."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULTS_PREFIX)]
    if not lines:
        return None
    try:
        results = json.loads(lines[-1][len(RESULTS_PREFIX):])
    except ValueError:
        return None
    return results if isinstance(results, list) else None


def passed(stdout: str, exit_code: int | None, stopped_reason: str | None, expected: list[Any]) -> bool:
    """The run ended by itself with exit code 0 and reported, for every test, exactly the expected value."""
    results = reported_results(stdout)
    if exit_code != 0 or stopped_reason is not None or results is None or len(results) != len(expected):
        return False
    return all(isinstance(r, dict) and r.get("value") == encode(e) for r, e in zip(results, expected))


async def grade(sandbox: Sandbox, code: str, tests: str,
                limits: SandboxLimits | None = None) -> tuple[float, dict[str, Any]]:
    """(1.0 or 0.0, what happened) for `code` against `tests` (lines `assert EXPR == LITERAL` using the solution's
    names)."""
    cases = split_tests(tests)
    result = await sandbox.run(code=RUNNER, files=grading_files(code, [call for call, _ in cases]),
                               limits=limits or SandboxLimits(wall_time_s=5))
    ok = passed(result.stdout, result.exit_code, result.stopped_reason, [expected for _, expected in cases])
    details = {"passed": ok, "exit_code": result.exit_code, "stopped_reason": result.stopped_reason,
               "stderr": result.stderr[-500:], "sandbox_error": result.sandbox_error}
    return float(ok), details
