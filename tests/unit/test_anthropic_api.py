"""The Anthropic Messages API translation: requests into vime's chat request, a Completion into a Message and its
stream events, checked against the anthropic package's types and its real client (on a local aiohttp server)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import pytest
from aiohttp import web
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.helpers.canned_api import send_events, serve
from vime.agents.api import anthropic_api as A
from vime.agents.api.completion import ChoiceOut, Completion, ToolCallOut, canonical_arguments

READ = {"name": "read", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
CALLS = [ToolCallOut("call_a1", "read", canonical_arguments({"path": "src/é.py", "lines": [1, 2]})),
         ToolCallOut("call_a2", "ls", canonical_arguments({}))]
COMPLETIONS = {
    "text": Completion("chatcmpl-m1", "policy", 1700000000, 11,
                       [ChoiceOut(0, "Héllo — 世界, all done.", finish_reason="stop", completion_tokens=9)]),
    "tools": Completion("chatcmpl-m2", "policy", 1700000001, 23,
                        [ChoiceOut(0, "Let me look.", CALLS, finish_reason="tool_calls", completion_tokens=31)]),
    "length": Completion("chatcmpl-m3", "policy", 1700000002, 5,
                         [ChoiceOut(0, "It was a dark and", finish_reason="length", completion_tokens=6)]),
}


def _tool_message(call_id, content):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# ---- requests ------------------------------------------------------------------------------------------------
def test_request_with_every_field():
    body = {
        "model": "policy", "max_tokens": 128, "stream": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "stop_sequences": ["END"], "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse.",
                                                          "cache_control": {"type": "ephemeral"}}],
        "tools": [READ, {"name": "ls", "input_schema": {"type": "object"}, "type": "custom"}],
        "tool_choice": {"type": "tool", "name": "read"},
        "messages": [
            {"role": "user", "content": "Fix the bug."},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking"}, {"type": "text", "text": "."},
                {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.py"}},
                {"type": "tool_use", "id": "t2", "name": "ls", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"},
                {"type": "text", "text": "Also "},
                {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                 "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "such dir"}]},
                {"type": "text", "text": "hurry."}]},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3"}]},
            {"role": "assistant", "content": [{"type": "text", "text": ""}]},
            {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
        ]}
    assert A.chat_request(body) == {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Fix the bug."},
            {"role": "assistant", "content": "Looking.", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}},
                {"id": "t2", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
            _tool_message("t1", "print(1)"),
            _tool_message("t2", "no such dir"),
            {"role": "user", "content": "Also hurry."},
            {"role": "assistant", "content": "Done."},
            _tool_message("t3", ""),
            {"role": "assistant", "content": None},
            {"role": "user", "content": "Thanks."}],
        "max_tokens": 128,
        "tools": [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                                    "parameters": READ["input_schema"]}},
                  {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "read"}},
        "stop": ["END"], "model": "policy", "temperature": 0.6, "top_p": 0.95, "top_k": 20, "stream": True}


def test_only_the_set_fields_are_sent():
    body = {"max_tokens": 8, "system": "", "temperature": None, "messages": [{"role": "user", "content": "hi"}]}
    assert A.chat_request(body) == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    body = {"max_tokens": 8, "system": "s", "messages": [{"role": "system", "content": "more"},
                                                         {"role": "user", "content": "hi"}]}
    assert A.chat_request(body)["messages"] == [{"role": "system", "content": "s"},
                                                {"role": "system", "content": "more"},
                                                {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, "auto"), ({"type": "any", "disable_parallel_tool_use": True}, "required"),
    ({"type": "none"}, "none"), ({"type": "tool", "name": "ls"}, {"type": "function", "function": {"name": "ls"}}),
])
def test_tool_choice(choice, expected):
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": choice}
    assert A.chat_request(body)["tool_choice"] == expected


def _user(content):
    return {"max_tokens": 8, "messages": [{"role": "user", "content": content}]}


def _assistant(content):
    return {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]}


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "'max_tokens' is required"),
    ({**_user("hi"), "max_tokens": 0}, "'max_tokens' is required"),
    ({**_user("hi"), "max_tokens": "8"}, "'max_tokens' is required"),
    ({**_user("hi"), "max_tokens": True}, "'max_tokens' is required"),
    ({"max_tokens": 8}, "'messages' must be a non-empty list"),
    ({"max_tokens": 8, "messages": []}, "'messages' must be a non-empty list"),
    ({"max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}, "role must be user or assistant"),
    (_user([]), "must be a string or a list of typed content blocks"),
    (_user([{"text": "untyped"}]), "must be a string or a list of typed content blocks"),
    (_user([{"type": "image", "source": {"type": "url", "url": "x"}}]), "'image'"),
    (_user([{"type": "document", "source": {}}]), "'document'"),
    (_user([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]), "'image'"),
    (_user([{"type": "tool_result", "content": "x"}]), "needs the 'tool_use_id'"),
    (_assistant([{"type": "thinking", "thinking": "hm", "signature": "s"}]), "'thinking'"),
    (_assistant([{"type": "redacted_thinking", "data": "x"}]), "'redacted_thinking'"),
    (_assistant([{"type": "tool_use", "id": "t", "name": "ls", "input": "[]"}]), "an 'input' object"),
    (_assistant([{"type": "tool_use", "name": "ls", "input": {}}]), "needs 'id', 'name'"),
    ({**_user("hi"), "system": [{"type": "image", "source": {}}]}, "'image' (in system)"),
    ({**_user("hi"), "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only client tools"),
    ({**_user("hi"), "tools": [{"type": "bash_20250124", "name": "bash"}]}, "'bash_20250124'"),
    ({**_user("hi"), "tools": [{"name": "ls"}]}, "needs a 'name' and an 'input_schema'"),
    ({**_user("hi"), "tool_choice": {"type": "tool"}}, "not supported"),
    ({**_user("hi"), "tool_choice": "auto"}, "not supported"),
])
def test_refused_requests(body, message):
    with pytest.raises(ValueError) as error:
        A.chat_request(body)
    assert message in str(error.value)


# ---- round trip: our own answer, re-sent, is exactly the recorded assistant message ----------------------------
@pytest.mark.parametrize("choice", [
    COMPLETIONS["tools"].choices[0],
    COMPLETIONS["text"].choices[0],
    ChoiceOut(0, "", CALLS, finish_reason="tool_calls"),
])
def test_resent_answer_is_the_chat_message(choice):
    content = A.message_object(Completion("chatcmpl-rt", "policy", 0, 3, [choice]))["content"]
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": "ok"} for c in choice.tool_calls]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": content}]
    if results:
        messages.append({"role": "user", "content": results})
    assert A.chat_request({"max_tokens": 8, "messages": messages})["messages"] == [
        {"role": "user", "content": "go"}, choice.chat_message(), *[_tool_message(c.id, "ok")
                                                                     for c in choice.tool_calls]]
    # Content the harness parsed and re-serialized its own way (ASCII-escaped, compact) comes back the same.
    resent = json.loads(json.dumps(content, separators=(",", ":")))
    assert A.chat_messages({"role": "assistant", "content": resent}) == [choice.chat_message()]


# ---- responses -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice, stop_reason, stop_sequence", [
    (COMPLETIONS["tools"].choices[0], "tool_use", None),
    (COMPLETIONS["length"].choices[0], "max_tokens", None),
    (ChoiceOut(0, "a", stop_string="END"), "stop_sequence", "END"),
    (COMPLETIONS["text"].choices[0], "end_turn", None),
])
def test_stop_reason(choice, stop_reason, stop_sequence):
    message = A.message_object(Completion("chatcmpl-s", "policy", 0, 1, [choice]))
    Message.model_validate(message)
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)


def test_message_object_with_tool_calls():
    assert A.message_object(COMPLETIONS["tools"]) == {
        "id": "msg_m2", "type": "message", "role": "assistant", "model": "policy",
        "content": [{"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "call_a1", "name": "read",
                     "input": {"path": "src/é.py", "lines": [1, 2]}},
                    {"type": "tool_use", "id": "call_a2", "name": "ls", "input": {}}],
        "stop_reason": "tool_use", "stop_sequence": None, "stop_details": None,
        "usage": {"input_tokens": 23, "output_tokens": 31}}
    tool_only = Completion("chatcmpl-x", "policy", 0, 1, [ChoiceOut(0, "", CALLS[1:], finish_reason="tool_calls")])
    assert [block["type"] for block in A.message_object(tool_only)["content"]] == ["tool_use"]


def test_stream_events():
    events = A.stream_events(COMPLETIONS["tools"])
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start", *["content_block_delta"] * 4, "content_block_stop",
        "content_block_start", *["content_block_delta"] * 4, "content_block_stop",
        "content_block_start", *["content_block_delta"] * 2, "content_block_stop",
        "message_delta", "message_stop"]
    adapter = TypeAdapter(RawMessageStreamEvent)
    for name, data in events:
        assert data["type"] == name
        adapter.validate_python(data)
    start = events[0][1]["message"]
    assert (start["id"], start["content"], start["stop_reason"], start["usage"]) == (
        "msg_m2", [], None, {"input_tokens": 23, "output_tokens": 0})
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert "".join(d["delta"]["text"] for d in deltas if d["index"] == 0) == "Let me look."
    assert "".join(d["delta"]["partial_json"] for d in deltas if d["index"] == 1) == CALLS[0].arguments
    assert "".join(d["delta"]["partial_json"] for d in deltas if d["index"] == 2) == CALLS[1].arguments
    assert [d["content_block"] for n, d in events if n == "content_block_start"] == [
        {"type": "text", "text": ""}, {"type": "tool_use", "id": "call_a1", "name": "read", "input": {}},
        {"type": "tool_use", "id": "call_a2", "name": "ls", "input": {}}]
    assert events[-2][1] == {"type": "message_delta", "usage": {"output_tokens": 31},
                             "delta": {"stop_reason": "tool_use", "stop_sequence": None, "stop_details": None}}


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (529, "overloaded_error"),
])
def test_error_body(status, kind):
    assert A.error_body(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}


# ---- the real anthropic client -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    """A tiny endpoint answering POST /v1/messages with the Completion its `model` names (else a 404 error)."""
    received = []

    async def messages(request: web.Request):
        body = await request.json()
        received.append(body)
        completion = COMPLETIONS.get(body["model"])
        if completion is None:
            return web.json_response(A.error_body(404, f"no model {body['model']}"), status=404)
        if body.get("stream"):
            return await send_events(request, A.stream_events(completion))
        return web.json_response(A.message_object(completion))

    with serve("/v1/messages", messages) as root:
        client = anthropic.Anthropic(base_url=f"{root}", api_key="k", max_retries=0, timeout=10)
        yield SimpleNamespace(client=client, received=received)
        client.close()


def _ask(name):
    return {"model": name, "max_tokens": 64, "tools": [READ], "messages": [{"role": "user", "content": "go"}]}


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_client_parses_messages(server, name):
    completion = COMPLETIONS[name]
    message = server.client.messages.create(**_ask(name))
    assert message.to_dict() == A.message_object(completion)
    choice = completion.choices[0]
    assert [b.text for b in message.content if b.type == "text"] == [choice.text]
    assert [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"] == [
        (c.id, c.name, json.loads(c.arguments)) for c in choice.tool_calls]
    assert message.stop_reason == {"text": "end_turn", "tools": "tool_use", "length": "max_tokens"}[name]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (completion.prompt_tokens,
                                                                         choice.completion_tokens)


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_client_stream_equals_the_whole_message(server, name):
    whole = server.client.messages.create(**_ask(name))
    with server.client.messages.stream(**_ask(name)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.to_dict() == whole.to_dict()
    assert text == COMPLETIONS[name].choices[0].text
    events = list(server.client.messages.create(**_ask(name), stream=True))
    assert [e.type for e in events] == [name for name, _ in A.stream_events(COMPLETIONS[name])]


def test_client_follow_up_extends_the_recorded_conversation(server):
    """The usual SDK loop (messages += the answer's content, then tool results) re-sends our answer unchanged."""
    first = server.client.messages.create(**_ask("tools"))
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "ok"} for b in first.content
               if b.type == "tool_use"]
    server.client.messages.create(model="text", max_tokens=64, tools=[READ], messages=[
        {"role": "user", "content": "go"}, {"role": "assistant", "content": first.content},
        {"role": "user", "content": results}])
    assert A.chat_request(server.received[-1])["messages"] == [
        {"role": "user", "content": "go"}, COMPLETIONS["tools"].choices[0].chat_message(),
        _tool_message("call_a1", "ok"), _tool_message("call_a2", "ok")]


def test_client_raises_the_error_body(server):
    with pytest.raises(anthropic.NotFoundError) as error:
        server.client.messages.create(**_ask("missing"))
    assert error.value.status_code == 404
    assert error.value.body == {"type": "error", "error": {"type": "not_found_error", "message": "no model missing"}}
