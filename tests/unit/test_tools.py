"""Tools: the safe calculator, the sandboxed python tool, and how calls fail (as messages, never raising)."""

from __future__ import annotations

import asyncio

import pytest

from vime.agents.sandbox import SandboxResult
from vime.agents.tool_parsing import ToolCall, ToolCallError
from vime.agents.tools import (TOOLS, Tool, ToolContext, format_run_output, register_tool, run_tool_call, safe_eval,
                               select_tools)


@pytest.mark.parametrize("expr, value", [("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("-7 // 2", -4), ("2 ** 10", 1024),
                                         ("7 / 2", 3.5), ("10 % 4", 2), ("3 ^ 2", 9), ("1.5 * 2", 3.0)])
def test_calculator_arithmetic(expr, value):
    assert safe_eval(expr) == value


@pytest.mark.parametrize("expr, message", [
    ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"), ("'a' * 3", "only numbers"),
    ("1 / 0", "division by zero"), ("9 ** 9 ** 9", "power too large"), ("10 ** 200", "power too large"),
    ("1 +", "not an arithmetic"), ("", "non-empty"), ("1+" * 200 + "1", "longer than"),
])
def test_calculator_refuses(expr, message):
    with pytest.raises(ValueError, match=message):
        safe_eval(expr)


def _call(call, tools=None, timeout=5.0):
    return asyncio.run(run_tool_call(call, tools or select_tools(None, ["calculator", "python"]),
                                     ToolContext(timeout_s=timeout)))


def test_calculator_tool_formats_integers():
    assert _call(ToolCall("calculator", {"expression": "6 * 7"})) == "42"
    assert _call(ToolCall("calculator", {"expression": "1 / 4"})) == "0.25"
    assert _call(ToolCall("calculator", {"expression": "4 / 2"})) == "2"


def test_python_tool_runs_in_the_sandbox():
    assert _call(ToolCall("python", {"code": "print(sum(range(10)))"})) == "45"
    out = _call(ToolCall("python", {"code": "raise ValueError('bad')"}))
    assert "ValueError: bad" in out and "[exit code 1]" in out
    out = _call(ToolCall("python", {"code": "open('/etc/vime_x', 'w')"}))
    assert "[stopped: forbidden_write]" in out


def test_python_tool_time_limit_inside_the_call_timeout():
    out = _call(ToolCall("python", {"code": "while True: pass"}), timeout=2.0)
    assert out.endswith("[stopped: timeout]")


def test_failures_become_messages():
    assert _call(ToolCallError("tool call is not valid JSON")) == "Error: tool call is not valid JSON"
    assert "unknown tool 'search'" in _call(ToolCall("search", {}))
    assert "Error: ValueError: expression must be" in _call(ToolCall("calculator", {}))

    async def slow(arguments, ctx):
        await asyncio.sleep(10)

    tools = {"slow": Tool("slow", "sleeps", {"type": "object"}, slow)}
    assert _call(ToolCall("slow", {}), tools, timeout=0.2) == "Error: tool 'slow' timed out after 0.2 s"


def test_select_tools_from_sample_schemas_or_defaults():
    schemas = [TOOLS["calculator"].schema()]
    assert list(select_tools(schemas, ["python"])) == ["calculator"]
    assert list(select_tools(None, ["python"])) == ["python"]
    assert list(select_tools(["python", "calculator"], [])) == ["python", "calculator"]
    with pytest.raises(ValueError, match="unknown tools"):
        select_tools(["nope"], [])


def test_register_tool_refuses_a_second_tool_of_the_same_name():
    async def run(arguments, ctx):
        return ""

    with pytest.raises(ValueError, match="already registered"):
        register_tool(Tool("calculator", "", {}, run))


def test_format_run_output_order_and_truncation():
    r = SandboxResult(stdout="out\n", stderr="err", exit_code=-9, stopped_reason="timeout")
    assert format_run_output(r) == "out\nerr\n[stopped: timeout]"
    assert format_run_output(SandboxResult("x" * 50, "", 0), max_chars=10) == "x" * 10 + "\n[output truncated]"
