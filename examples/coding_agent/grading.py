"""Grading a final answer: hidden tests import the solution from a file, and must print a fresh nonce at the end.

    score, details = await grade(sandbox, code="def f(x):\\n    return x + 1", tests="assert f(1) == 2")

Why not run `code + "\\n" + tests` as one program: the model's code runs first, so `os._exit(0)` (or
`sys.exit(0)`) ends the run with exit code 0 before any test, which scored 1.0.
Here the sandbox runs a fixed test program (RUNNER) beside three files: `solution.py` (the model's code),
`tests.py` (the hidden asserts) and `.nonce` (random per grading). The test program first moves the nonce into
a pipe and deletes `.nonce` and `tests.py`, then imports the solution and runs the tests, and only after the
last assertion writes the nonce from the pipe. An answer scores 1 only when the run ended by itself with exit
code 0 *and* printed the nonce: code that exits early, crashes or skips the tests never got to
see it. `==` in the tests also wants both sides of one type, so an object whose `__eq__` always answers True
passes nothing. What is left: code written to hunt for it (reading every open descriptor during its import) could still
find the pipe; only a grader in a process of its own, comparing values it computed itself, would close that.
"""

from __future__ import annotations

import secrets
from typing import Any

from vime.agents.sandbox import Sandbox, SandboxLimits

RUNNER = r'''
import ast
import os
import sys


def _same(a, b, _type=type):
    """`==` in the tests: of one type, then equal (an object whose __eq__ always says True is no answer)."""
    return _type(a) is _type(b) and a == b


class _StrictEq(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            call = ast.Call(ast.Name("__same__", ast.Load()), [node.left, node.comparators[0]], [])
            return ast.copy_location(call, node)
        return node


def _stash_nonce():
    """Into a pipe, out of the file system and out of every Python frame, before the solution runs."""
    r, w = os.pipe()
    with open(".nonce", "rb") as f:
        os.write(w, f.read())
    os.close(w)
    os.unlink(".nonce")
    return r


def main():
    nonce_fd = _stash_nonce()
    with open("tests.py") as f:
        tests = ast.fix_missing_locations(_StrictEq().visit(ast.parse(f.read(), "tests.py")))
    os.unlink("tests.py")
    write, read = os.write, os.read  # the solution may replace os.*; these stay ours
    sys.path.insert(0, os.getcwd())
    namespace = {"__name__": "hidden_tests"}
    exec("from solution import *", namespace)
    namespace["__same__"] = _same
    exec(compile(tests, "tests.py", "exec"), namespace)
    sys.stdout.flush()
    write(1, b"\n" + read(nonce_fd, 256) + b"\n")


main()
'''


def grading_files(code: str, tests: str, nonce: str) -> dict[str, str]:
    return {"solution.py": code, "tests.py": tests, ".nonce": nonce}


def passed(stdout: str, exit_code: int | None, stopped_reason: str | None, nonce: str) -> bool:
    """The run ended by itself, with exit code 0, and printed the nonce on a line of its own (all tests ran)."""
    return exit_code == 0 and stopped_reason is None and nonce in stdout.splitlines()


async def grade(sandbox: Sandbox, code: str, tests: str,
                limits: SandboxLimits | None = None) -> tuple[float, dict[str, Any]]:
    """(1.0 or 0.0, what happened) for `code` against `tests` (Python asserts that use the solution's names)."""
    nonce = secrets.token_hex(16)
    result = await sandbox.run(code=RUNNER, files=grading_files(code, tests, nonce),
                               limits=limits or SandboxLimits(wall_time_s=5))
    ok = passed(result.stdout, result.exit_code, result.stopped_reason, nonce)
    details = {"passed": ok, "exit_code": result.exit_code, "stopped_reason": result.stopped_reason,
               "stderr": result.stderr[-500:]}
    return float(ok), details
