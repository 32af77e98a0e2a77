"""Parse tool calls out of model text. Pure functions, no I/O.

Two formats are understood:
- Qwen style: one or more `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks per turn;
- JSON: the turn (or a ```json fenced block in it) is one object `{"name": ..., "arguments": {...}}`.

A malformed call never raises: it becomes a `ToolCallError` that the environment reports back to the model
as a tool message, so a broken call is a learning signal, not a crashed rollout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
JSON_FENCE = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolCallError:
    """A call the model tried to make but that cannot be run; `message` is shown to the model."""

    message: str
    raw: str = ""


def _call_from_json(raw: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(f"tool call is not valid JSON ({e.msg} at column {e.colno})", raw)
    if not isinstance(obj, dict):
        return ToolCallError(f"tool call must be a JSON object, got {type(obj).__name__}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError('tool call needs a string "name"', raw)
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI-style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCallError(f'tool call "{name}": "arguments" is a string but not JSON', raw)
    if not isinstance(arguments, dict):
        return ToolCallError(f'tool call "{name}": "arguments" must be an object', raw)
    return ToolCall(name, arguments)


def parse_qwen_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every `<tool_call>...</tool_call>` block, in order; an unclosed last block is parsed too."""
    return [_call_from_json(m.group(1).strip()) for m in QWEN_CALL.finditer(text)]


def parse_json_tool_call(text: str) -> list[ToolCall | ToolCallError]:
    """The whole turn, or its first ```json fenced block, as one call; [] when the text is not a call."""
    fenced = JSON_FENCE.search(text)
    raw = fenced.group(1) if fenced else text.strip()
    if not raw.startswith("{"):
        return []
    call = _call_from_json(raw)
    if isinstance(call, ToolCallError) and not fenced and '"name"' not in raw:
        return []  # plain prose that happens to start with "{" is an answer, not a broken call
    return [call]


def parse_tool_calls(text: str, fmt: str = "auto") -> list[ToolCall | ToolCallError]:
    """Tool calls in one model turn. fmt: "qwen", "json" or "auto" (qwen tags first, else JSON)."""
    if fmt not in ("auto", "qwen", "json"):
        raise ValueError(f"tool call format must be auto, qwen or json, got {fmt!r}")
    if fmt in ("auto", "qwen"):
        calls = parse_qwen_tool_calls(text)
        if calls or fmt == "qwen":
            return calls
    return parse_json_tool_call(text)


def split_tool_calls(text: str, fmt: str = "auto") -> tuple[str, list[ToolCall]]:
    """(the turn's content without its tool-call markup, its well-formed calls), for an API that returns calls
    as structured objects. A turn with a malformed call is returned whole as content with no calls: the harness
    sees what the model wrote, and the training record is the same tokens either way."""
    calls = parse_tool_calls(text, fmt)
    if not calls or any(isinstance(c, ToolCallError) for c in calls):
        return text, []
    if QWEN_CALL.search(text) and fmt in ("auto", "qwen"):
        return QWEN_CALL.sub("", text).strip(), calls
    if JSON_FENCE.search(text):  # the JSON format: the fenced block is the call, prose around it the content
        return JSON_FENCE.sub("", text, count=1).strip(), calls
    return "", calls  # the whole turn is the call


def forced_call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call in the JSON format, `{"name": ..., "arguments": {...}}`, to one of the chat
    `tools` (or to `name` only): what the engine's structured output holds a reply to when a request requires a
    tool call (tool_choice "required" or a named function)."""
    options = []
    for tool in tools:
        function = tool.get("function") or {}
        if name is not None and function.get("name") != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": function.get("name")},
                                                         "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    if not options:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the request's tools")
    return options[0] if len(options) == 1 else {"anyOf": options}
