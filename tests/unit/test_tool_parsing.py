"""Tool-call parsing: Qwen tags and JSON, several calls per turn, malformed calls as errors (never raising)."""

from __future__ import annotations

import pytest

from vime.agents.tool_parsing import ToolCall, ToolCallError, parse_tool_calls


def test_qwen_several_calls_in_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call> done')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2+3"}),
                                      ToolCall("python", {"code": "print(1)"})]


def test_qwen_unclosed_last_call_and_string_arguments():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'
    assert parse_tool_calls(text, "qwen") == [ToolCall("f", {"x": 1})]


def test_json_plain_and_fenced():
    assert parse_tool_calls('{"name": "calculator", "arguments": {"expression": "1"}}') == [
        ToolCall("calculator", {"expression": "1"})]
    fenced = 'I will call:\n```json\n{"name": "python", "parameters": {"code": "1"}}\n```'
    assert parse_tool_calls(fenced, "json") == [ToolCall("python", {"code": "1"})]


def test_no_call_in_plain_answers():
    assert parse_tool_calls("The answer is \\boxed{5}.") == []
    assert parse_tool_calls("{not a call, just braces}") == []
    assert parse_tool_calls('<tool_call>{"name": "x"}</tool_call>', "json") == []  # json format ignores tags


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'needs a string "name"'),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be an object'),
    ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "is a string but not JSON"),
    ('{"name": "calculator", "arguments": {"expression": }', "not valid JSON"),
])
def test_malformed_calls_become_errors(text, message):
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert message in calls[0].message


def test_mixed_good_and_bad_calls_keep_order():
    calls = parse_tool_calls('<tool_call>{"name": "a"}</tool_call><tool_call>{bad</tool_call>')
    assert isinstance(calls[0], ToolCall) and calls[0].name == "a" and calls[0].arguments == {}
    assert isinstance(calls[1], ToolCallError)


def test_unknown_format_is_a_usage_error():
    with pytest.raises(ValueError, match="auto, qwen or json"):
        parse_tool_calls("x", "xml")
