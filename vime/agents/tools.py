"""A small tool registry and two tools: `calculator` (safe arithmetic) and `python` (code in a sandbox).

A tool is an async function `run(arguments: dict, ctx: ToolContext) -> str` plus the JSON schema the model
sees. `run_tool_call` runs one parsed call with a time limit and turns every failure (unknown tool, bad
arguments, timeout, a crash) into a message for the model, never an exception out of the rollout.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from vime.agents.tool_parsing import ToolCall, ToolCallError
from vime.rollout.sandbox_runs import record_sandbox_run


@dataclass
class ToolContext:
    """What a tool may use besides its arguments."""

    args: Any = None  # the run's args
    sample: Any = None  # the Sample being generated
    sandbox: Any = None  # a vime.agents.sandbox.Sandbox, for tools that run code
    timeout_s: float = 10.0  # this call's time limit; tools that start processes should stay within it
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    run: Callable[[dict[str, Any], ToolContext], Awaitable[str]]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style schema chat templates render (`tools=[...]`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    if tool.name in TOOLS and TOOLS[tool.name] is not tool:
        raise ValueError(f"a tool named {tool.name!r} is already registered")
    TOOLS[tool.name] = tool
    return tool


# ---- calculator: arithmetic on numbers, nothing else -------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**100  # bigger results are refused: they cost time and memory and no task needs them


def safe_eval(expression: str) -> int | float:
    """Evaluate + - * / // % ** and parentheses on int/float literals; ValueError for anything else."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 1000 or (abs(left) > 1 and abs(right) * math.log10(
                abs(left)) > 100)):
            raise ValueError("power too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"only numbers and + - * / // % ** are allowed, found {type(node).__name__}")


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(round(value, 10)) if isinstance(value, float) else str(value)


async def _calculator(arguments: dict[str, Any], ctx: ToolContext) -> str:
    return format_number(safe_eval(arguments.get("expression")))


CALCULATOR = register_tool(Tool(
    name="calculator",
    description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    run=_calculator,
))


# ---- python: the code runs in a sandbox ---------------------------------------------------------------------

def format_run_output(result, max_chars: int = 2000) -> str:
    """stdout, then stderr, then why it stopped: what the model reads after running code."""
    parts = [result.stdout]
    if result.stderr:
        parts.append(result.stderr)
    if result.stopped_reason:
        parts.append(f"[stopped: {result.stopped_reason}]")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    text = "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts).strip("\n")
    if len(text) > max_chars:
        text = text[:max_chars] + "\n[output truncated]"
    return text


async def _python(arguments: dict[str, Any], ctx: ToolContext) -> str:
    from vime.agents.sandbox import LocalSandbox, SandboxLimits

    code = arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        raise ValueError('python needs "code" (a string)')
    try:
        sandbox = ctx.sandbox or LocalSandbox()
        # the sandbox's own wall limit sits inside the call's timeout, so the process tree is always reaped
        result = await sandbox.run(code=code, limits=SandboxLimits(wall_time_s=max(0.5, ctx.timeout_s - 1.0)))
    except Exception as e:  # the sandbox could not run it (refused, unreachable): its failure, not the model's
        record_sandbox_run(ctx.sample, "tool", f"{type(e).__name__}: {e}")
        raise
    record_sandbox_run(ctx.sample, "tool", result.sandbox_error)
    return format_run_output(result) or "[no output]"


PYTHON = register_tool(Tool(
    name="python",
    description="Run Python code in a sandbox (no network, no files outside its directory); returns its output.",
    parameters={"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    run=_python,
))


# ---- running calls ------------------------------------------------------------------------------------------

def select_tools(names_or_schemas: list[Any] | None, default_names: list[str]) -> dict[str, Tool]:
    """Tools offered to one sample: its `tools` field (schemas or names) when present, else the defaults."""
    wanted = []
    for item in names_or_schemas if names_or_schemas is not None else default_names:
        if isinstance(item, dict):
            item = item.get("function", item).get("name")
        wanted.append(item)
    missing = [n for n in wanted if n not in TOOLS]
    if missing:
        raise ValueError(f"unknown tools {missing}; registered: {sorted(TOOLS)} (add yours with register_tool)")
    return {n: TOOLS[n] for n in wanted}


async def run_tool_call(call: ToolCall | ToolCallError, tools: dict[str, Tool], ctx: ToolContext) -> str:
    """Run one call within ctx.timeout_s; the returned text is the tool message the model sees."""
    if isinstance(call, ToolCallError):
        return f"Error: {call.message}"
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or 'none'}"
    try:
        return str(await asyncio.wait_for(tool.run(call.arguments, ctx), timeout=ctx.timeout_s))
    except asyncio.TimeoutError:
        return f"Error: tool {call.name!r} timed out after {ctx.timeout_s:g} s"
    except Exception as e:  # a tool's failure is the model's feedback, not the rollout's crash
        return f"Error: {type(e).__name__}: {e}"
