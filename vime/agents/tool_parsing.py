"""Parse tool calls out of model text. Pure functions, no I/O.

Two formats are understood:
- Qwen style: one or more `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks per turn;
- JSON: the turn (or a ```json fenced block in it) is one object `{"name": ..., "arguments": {...}}`.

A malformed call never raises: it becomes a `ToolCallError` that the environment reports back to the model
as a tool message, so a broken call is a learning signal, not a crashed rollout. The text is the policy's, so
parsing it takes time linear in its length (no backtracking regex over it), and a call nested deeper than
MAX_CALL_NESTING is a malformed call, not a RecursionError.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)  # linear: one scan per block
# A fenced call is an opening, the object, a closing. Each pattern alone is linear: a failed try backtracks
# over one run of whitespace, which one fence or "}" precedes.
FENCE_OPENING = re.compile(r"```(?:json)?\s*\{")
FENCE_CLOSING = re.compile(r"\}\s*```")
# Deeper than any real call's arguments; json.loads raises RecursionError near 1,000 levels, and what it does
# return must still be serialized (canonical_arguments) and rendered by the chat template.
MAX_CALL_NESTING = 100


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolCallError:
    """A call the model tried to make but that cannot be run; `message` is shown to the model."""

    message: str
    raw: str = ""


class NestedTooDeep(ValueError):
    """JSON nested deeper than MAX_CALL_NESTING."""


def loads_bounded(raw: str) -> Any:
    """json.loads of text the policy wrote: json.JSONDecodeError when it is not JSON, NestedTooDeep when it is
    nested deeper than MAX_CALL_NESTING (both ValueErrors)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise NestedTooDeep(f"nested deeper than {MAX_CALL_NESTING} levels") from None
    if _nesting(value) > MAX_CALL_NESTING:
        raise NestedTooDeep(f"nested deeper than {MAX_CALL_NESTING} levels")
    return value


def _nesting(value: Any) -> int:
    """How deep lists and dicts nest in `value`, without recursion (what is checked may be ~1,000 deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _call_from_json(raw: str) -> ToolCall | ToolCallError:
    try:
        obj = loads_bounded(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(f"tool call is not valid JSON ({e.msg} at column {e.colno})", raw)
    except NestedTooDeep as e:
        return ToolCallError(f"tool call is {e}; send flatter arguments", raw)
    if not isinstance(obj, dict):
        return ToolCallError(f"tool call must be a JSON object, got {type(obj).__name__}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError('tool call needs a string "name"', raw)
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI-style: arguments as a JSON string
        try:
            arguments = loads_bounded(arguments)
        except json.JSONDecodeError:
            return ToolCallError(f'tool call "{name}": "arguments" is a string but not JSON', raw)
        except NestedTooDeep as e:
            return ToolCallError(f'tool call "{name}": "arguments" is {e}', raw)
    if not isinstance(arguments, dict):
        return ToolCallError(f'tool call "{name}": "arguments" must be an object', raw)
    return ToolCall(name, arguments)


def parse_qwen_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every `<tool_call>...</tool_call>` block, in order; an unclosed last block is parsed too."""
    return [_call_from_json(m.group(1).strip()) for m in QWEN_CALL.finditer(text)]


@dataclass
class Fence:
    """A fenced JSON object in a turn: text[start:end] is the whole block, `body` the object's text."""

    start: int
    end: int
    body: str


def find_json_fence(text: str) -> Fence | None:
    """The first ```json (or ```) block holding one object: what ```(?:json)?\\s*(\\{.*?\\})\\s*``` (DOTALL)
    finds, in linear time (that regex retries its lazy body from every fence: quadratic on the policy's text).
    Only the first opening matters: a later one's "{" is further on, so no closing that fails it serves it."""
    opening = FENCE_OPENING.search(text)
    if opening is None:
        return None
    brace = opening.end() - 1
    closing = FENCE_CLOSING.search(text, brace + 1)
    if closing is None:
        return None
    return Fence(opening.start(), closing.end(), text[brace:closing.start() + 1])


def parse_json_tool_call(text: str) -> list[ToolCall | ToolCallError]:
    """The whole turn, or its first ```json fenced block, as one call; [] when the text is not a call."""
    fenced = find_json_fence(text)
    raw = fenced.body if fenced else text.strip()
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
    fenced = find_json_fence(text)
    if fenced:  # the JSON format: the fenced block is the call, prose around it the content
        return (text[:fenced.start] + text[fenced.end:]).strip(), calls
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
