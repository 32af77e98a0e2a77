"""Tool-call parsing: Qwen tags and JSON, several calls per turn, malformed calls as errors (never raising), and
what a hostile policy may write: linear time on 200 KB turns, deep nesting an invalid call."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from vime.agents.tool_parsing import (MAX_CALL_NESTING, ToolCall, ToolCallError, find_json_fence, parse_tool_calls,
                                      split_tool_calls)


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


# ---- what a hostile policy may write ---------------------------------------------------------------------------
ADVERSARIAL_TURNS = {  # about 200 KB each
    "fences_with_braces": "```{}x" * 34_000,  # the old fenced regex retried its lazy body from every fence
    "json_fences": "```json{" * 25_000,
    "bare_fences": "```" * 70_000,
    "closings_only": "} ```" * 40_000,
    "spaces_after_an_opening": "```json" + " " * 200_000 + "{",
    "unclosed_tags": "<tool_call>{" * 16_000,
}


@pytest.mark.parametrize("name", ADVERSARIAL_TURNS)
def test_adversarial_turns_parse_in_linear_time(name):
    text = ADVERSARIAL_TURNS[name]
    for fmt in ("auto", "qwen", "json"):
        seconds = _fastest(lambda: (parse_tool_calls(text, fmt), split_tool_calls(text, fmt)), bound=0.1)
        assert seconds < 0.1, f"{name} ({len(text)} chars, {fmt}): {seconds:.2f} s"


def _fastest(fn, bound: float, tries: int = 3) -> float:
    """The fastest of a few runs of `fn` (the machine is shared): tried again only when a run was over `bound`
    by less than tenfold, which is noise rather than a slow parser."""
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if best < bound or best > 10 * bound:
            break
    return best


DEEP = "[" * 1000 + "]" * 1000  # json.loads raises RecursionError on it


@pytest.mark.parametrize("text", [
    f"<tool_call>{DEEP}</tool_call>",
    f'<tool_call>{{"name": "f", "arguments": {{"x": {DEEP}}}}}</tool_call>',
    f'<tool_call>{{"name": "f", "arguments": {json.dumps(DEEP)}}}</tool_call>',  # OpenAI-style string arguments
    f'```json\n{{"name": "f", "arguments": {{"x": {DEEP}}}}}\n```',
    f'{{"name": "f", "arguments": {{"x": {"[" * 150 + "]" * 150}}}}}',  # parses, but too deep to pass on
])
def test_deep_nesting_is_an_invalid_call_not_an_exception(text):
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert f"nested deeper than {MAX_CALL_NESTING} levels" in calls[0].message
    assert split_tool_calls(text) == (text, [])  # the endpoint returns the turn as text, with no calls


def test_nesting_up_to_the_limit_is_a_call():
    def call(lists: int) -> str:  # the call object, its arguments and `lists` lists: lists + 2 levels
        return json.dumps({"name": "f", "arguments": {"x": json.loads("[" * lists + "]" * lists)}})

    assert isinstance(parse_tool_calls(call(MAX_CALL_NESTING - 2))[0], ToolCall)
    assert isinstance(parse_tool_calls(call(MAX_CALL_NESTING - 1))[0], ToolCallError)


def test_fenced_block_is_what_the_regex_it_replaces_found():
    regex = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)
    rng = random.Random(0)
    pieces = ["`", "```", "{", "}", "json", "js", " ", "\n", "\u3000", "x", '"name"']
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        match, fence = regex.search(text), find_json_fence(text)
        found = None if fence is None else (fence.start, fence.end, fence.body)
        assert found == (None if match is None else (match.start(), match.end(), match.group(1))), text


def test_echoed_deep_arguments_are_kept_as_sent():
    """A harness that sends back a call whose arguments are nested too deep to re-serialize: its string is kept
    (chat and Responses requests alike), not a RecursionError answered 500."""
    from vime.agents.api.responses_api import chat_request
    from vime.agents.chat_session import normalize_message

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    message = normalize_message({"role": "assistant", "content": "", "tool_calls": [call]})
    assert message["tool_calls"][0]["function"]["arguments"] == DEEP
    item = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP}
    chat = chat_request({"input": [{"role": "user", "content": "go"}, item]}, None)
    assert chat["messages"][-1]["tool_calls"][0]["function"]["arguments"] == DEEP
