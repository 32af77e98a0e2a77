"""The OpenAI Responses API translation: requests into vime's chat request, a Completion into a Response and its
stream events, checked against the openai package's types and its real client (on a local aiohttp server)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
from aiohttp import web
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.helpers.canned_api import send_events, serve
from vime.agents.api import responses_api as R
from vime.agents.api.completion import ChoiceOut, Completion, ToolCallOut, canonical_arguments

READ = {"type": "function", "name": "read", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
CALLS = [ToolCallOut("call_r1", "read", canonical_arguments({"path": "src/é.py", "lines": [1, 2]})),
         ToolCallOut("call_r2", "ls", canonical_arguments({}))]
COMPLETIONS = {
    "text": Completion("resp_t1", "policy", 1700000000, 11,
                       [ChoiceOut(0, "Héllo — 世界, all done.", finish_reason="stop", completion_tokens=9)]),
    "tools": Completion("resp_t2", "policy", 1700000001, 23,
                        [ChoiceOut(0, "Let me look.", CALLS, finish_reason="tool_calls", completion_tokens=31)]),
    "length": Completion("resp_t3", "policy", 1700000002, 5,
                         [ChoiceOut(0, "It was a dark and", finish_reason="length", completion_tokens=6)]),
}


def _tool_message(call_id, content):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# ---- requests ------------------------------------------------------------------------------------------------
def test_string_input_with_every_field():
    ls = {**READ, "name": "ls", "description": None, "strict": True}
    body = {"model": "policy", "input": "hi", "instructions": "Be brief.", "tools": [READ, ls],
            "tool_choice": {"type": "function", "name": "read"}, "max_output_tokens": 64, "temperature": 0.7,
            "top_p": 0.9, "stream": True, "store": False, "metadata": {"k": "v"}, "parallel_tool_calls": False}
    assert R.chat_request(body) == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                                    "parameters": READ["parameters"]}},
                  {"type": "function", "function": {"name": "ls", "parameters": READ["parameters"], "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "read"}},
        "max_tokens": 64, "model": "policy", "temperature": 0.7, "top_p": 0.9, "stream": True}


def test_only_the_set_fields_are_sent():
    assert R.chat_request({"input": "hi", "temperature": None}) == {"messages": [{"role": "user", "content": "hi"}]}


def test_input_items():
    body = {"input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules: "},
                                          {"type": "input_text", "text": "be kind."}]},
        {"role": "system", "content": "More rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the bug."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_9", "status": "completed",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"path":"a.py"}'},
        {"type": "reasoning", "id": "rs_2", "summary": []},
        {"type": "function_call", "call_id": "c2", "name": "ls", "arguments": "{}", "id": "fc_2"},
        {"type": "function_call_output", "call_id": "c1", "output": "print(1)"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "a.py\n"}, {"type": "input_text", "text": "b.py"}]},
        {"type": "function_call", "call_id": "c3", "name": "run", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c3", "output": ""},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks."},
    ]}
    assert R.chat_request(body)["messages"] == [
        {"role": "system", "content": "Rules: be kind."},
        {"role": "system", "content": "More rules."},
        {"role": "user", "content": "Fix the bug."},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}},
            {"id": "c2", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        _tool_message("c1", "print(1)"),
        _tool_message("c2", "a.py\nb.py"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "run", "arguments": "not json"}}]},
        _tool_message("c3", ""),
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks."},
    ]


def test_a_function_call_after_a_user_message_starts_an_assistant_message():
    body = {"input": [{"role": "user", "content": "go"},
                      {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
                      {"type": "function_call", "call_id": "c2", "name": "ls", "arguments": '{"a": 1}'}]}
    assert R.chat_request(body)["messages"][1:] == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}}]}]


def test_previous_messages_and_instructions():
    previous = [{"role": "system", "content": "old"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}]
    before = json.dumps(previous)
    follow_up = {"role": "user", "content": "next"}
    assert R.chat_request({"input": "next", "instructions": "new"}, previous)["messages"] == [
        {"role": "system", "content": "new"}, *previous[1:], follow_up]
    assert R.chat_request({"input": "next"}, previous)["messages"] == [*previous, follow_up]
    assert R.chat_request({"input": "next", "instructions": "new"}, previous[1:])["messages"] == [
        {"role": "system", "content": "new"}, *previous[1:], follow_up]
    assert json.dumps(previous) == before


@pytest.mark.parametrize("choice, expected", [
    ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "read"}, {"type": "function", "function": {"name": "read"}}),
])
def test_tool_choice(choice, expected):
    assert R.chat_request({"input": "hi", "tool_choice": choice})["tool_choice"] == expected


@pytest.mark.parametrize("body, message", [
    ({}, "'input' must be a non-empty"),
    ({"input": ""}, "'input' must be a non-empty"),
    ({"input": []}, "'input' must be a non-empty"),
    ({"input": 3}, "'input' must be a non-empty"),
    ({"input": ["hi"]}, "an input item must be an object"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "'input_image'"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_file", "file_id": "f"}]}]}, "'input_file'"),
    ({"input": [{"role": "user", "content": 3}]}, "must be a string or a list of parts"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role must be user, system, developer or assistant"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "'item_reference'"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "'web_search_call'"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "needs the 'call_id'"),
    ({"input": [{"type": "function_call", "name": "ls", "arguments": "{}"}]}, "needs 'call_id' and 'name'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "ls"}]}, "'arguments' must be a JSON string"),
    ({"input": "hi", "instructions": ["x"]}, "'instructions' must be a string"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools are served"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "'file_search'"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "needs a 'name'"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "not supported"),
    ({"input": "hi", "tool_choice": "any"}, "not supported"),
])
def test_refused_requests(body, message):
    with pytest.raises(ValueError) as error:
        R.chat_request(body)
    assert message in str(error.value)


# ---- round trip: our own output, re-sent, is exactly the recorded assistant message ----------------------------
@pytest.mark.parametrize("choice", [
    COMPLETIONS["tools"].choices[0],
    COMPLETIONS["text"].choices[0],
    ChoiceOut(0, "", CALLS, finish_reason="tool_calls"),
])
def test_resent_output_is_the_chat_message(choice):
    completion = Completion("resp_rt", "policy", 0, 3, [choice])
    output = R.response_object(completion, {"input": "go"})["output"]
    outputs = [{"type": "function_call_output", "call_id": c.id, "output": "ok"} for c in choice.tool_calls]
    messages = R.chat_request({"input": [{"role": "user", "content": "go"}, *output, *outputs]})["messages"]
    assert messages == [{"role": "user", "content": "go"}, choice.chat_message(),
                        *[_tool_message(c.id, "ok") for c in choice.tool_calls]]
    # Re-serialized arguments (compact, ASCII-escaped) still come back as the string we returned.
    for item in output:
        if item["type"] == "function_call":
            item["arguments"] = json.dumps(json.loads(item["arguments"]), separators=(",", ":"))
    assert R.chat_request({"input": output})["messages"] == [choice.chat_message()]


def test_previous_response_continues_with_its_answer():
    choice = COMPLETIONS["tools"].choices[0]
    previous = [{"role": "system", "content": "s"}, {"role": "user", "content": "go"}, choice.chat_message()]
    body = {"previous_response_id": "resp_t2", "instructions": "s",
            "input": [{"type": "function_call_output", "call_id": "call_r1", "output": "x"},
                      {"type": "function_call_output", "call_id": "call_r2", "output": "y"}]}
    assert R.chat_request(body, previous)["messages"] == [
        *previous, _tool_message("call_r1", "x"), _tool_message("call_r2", "y")]


# ---- responses -----------------------------------------------------------------------------------------------
def test_response_object_with_tool_calls():
    body = {"model": "policy", "input": "go", "tools": [READ], "instructions": "s", "temperature": 0.5,
            "previous_response_id": "resp_0", "user": "TOKEN/solver"}
    response = R.response_object(COMPLETIONS["tools"], body)
    Response.model_validate(response)
    assert response["id"] == "resp_t2" and response["object"] == "response"
    assert response["created_at"] == 1700000001 and response["model"] == "policy"
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["output"] == [
        {"id": "msg_t2", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"id": "fc_t2_0", "type": "function_call", "call_id": "call_r1", "name": "read",
         "arguments": '{"lines": [1, 2], "path": "src/é.py"}', "status": "completed"},
        {"id": "fc_t2_1", "type": "function_call", "call_id": "call_r2", "name": "ls", "arguments": "{}",
         "status": "completed"}]
    assert response["usage"] == {"input_tokens": 23, "input_tokens_details": {"cached_tokens": 0,
                                                                            "cache_write_tokens": 0},
                                 "output_tokens": 31, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 54}
    assert response["tools"] == [{**READ, "strict": None}]
    assert (response["instructions"], response["temperature"], response["top_p"]) == ("s", 0.5, None)
    assert (response["previous_response_id"], response["tool_choice"], response["error"]) == ("resp_0", "auto", None)
    assert response["text"] == {"format": {"type": "text"}} and response["metadata"] == {}
    assert "TOKEN/solver" not in json.dumps(response)  # the session id is a credential: never echoed


def test_truncated_and_tool_only_responses():
    response = R.response_object(COMPLETIONS["length"], {})
    Response.model_validate(response)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    only_calls = Completion("resp_x", "policy", 0, 1, [ChoiceOut(0, "", CALLS[:1], finish_reason="tool_calls")])
    assert [item["type"] for item in R.response_object(only_calls, {})["output"]] == ["function_call"]


def test_stream_events():
    completion = COMPLETIONS["tools"]
    events = R.stream_events(completion, {"input": "go"})
    assert [name for name, _ in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 4, "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", *["response.function_call_arguments.delta"] * 4,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", *["response.function_call_arguments.delta"] * 2,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    adapter = TypeAdapter(ResponseStreamEvent)
    for number, (name, data) in enumerate(events):
        assert data["type"] == name and data["sequence_number"] == number
        adapter.validate_python(data)
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    final = R.response_object(completion, {"input": "go"})
    assert events[-1][1]["response"] == final
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "Let me look."
    arguments = [d for n, d in events if n == "response.function_call_arguments.delta"]
    assert "".join(d["delta"] for d in arguments if d["output_index"] == 1) == CALLS[0].arguments
    assert "".join(d["delta"] for d in arguments if d["output_index"] == 2) == CALLS[1].arguments
    done = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert done == final["output"]
    assert [d["item"]["id"] for n, d in events if n == "response.output_item.added"] == ["msg_t2", "fc_t2_0",
                                                                                       "fc_t2_1"]


def test_truncated_stream_ends_incomplete():
    events = R.stream_events(COMPLETIONS["length"], {})
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"] == R.response_object(COMPLETIONS["length"], {})


# ---- the real openai client ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    """A tiny endpoint answering POST /v1/responses with the Completion its `model` names."""
    received = []

    async def responses(request: web.Request):
        body = await request.json()
        received.append(body)
        completion = COMPLETIONS[body["model"]]
        if body.get("stream"):
            return await send_events(request, R.stream_events(completion, body))
        return web.json_response(R.response_object(completion, body))

    with serve("/v1/responses", responses) as root:
        client = openai.OpenAI(base_url=f"{root}/v1", api_key="k", max_retries=0, timeout=10)
        yield SimpleNamespace(client=client, received=received)
        client.close()


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_client_parses_responses(server, name):
    completion = COMPLETIONS[name]
    response = server.client.responses.create(model=name, input="go", tools=[READ], instructions="s")
    assert response.to_dict() == R.response_object(completion, server.received[-1])
    assert response.id == completion.id and response.output_text == completion.choices[0].text
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [(c.id, c.name, c.arguments)
                                                                 for c in completion.choices[0].tool_calls]
    assert response.status == ("incomplete" if name == "length" else "completed")
    assert response.usage.total_tokens == completion.prompt_tokens + completion.choices[0].completion_tokens
    if name == "length":
        assert response.incomplete_details.reason == "max_output_tokens"


def _without_parsed(value):
    """A ParsedResponse as the plain Response it was parsed from: the stream helper adds `parsed` fields."""
    if isinstance(value, dict):
        return {k: _without_parsed(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [_without_parsed(v) for v in value]
    return value


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_client_stream_equals_the_whole_response(server, name):
    whole = server.client.responses.create(model=name, input="go", tools=[READ])
    events = list(server.client.responses.create(model=name, input="go", tools=[READ], stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == ("response.incomplete" if name == "length" else "response.completed")
    assert events[-1].response == whole
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    with server.client.responses.stream(model=name, input="go", tools=[READ]) as stream:
        if name == "length":  # openai 3.x's helper returns only a completed response; the stream still parses
            stream.until_done()
            return
        final = stream.get_final_response()
    assert _without_parsed(final.to_dict()) == whole.to_dict()
    assert final.output_text == whole.output_text


def test_client_follow_up_extends_the_recorded_conversation(server):
    """The usual SDK loop (input += response.output + tool outputs) re-sends our answer unchanged."""
    first = server.client.responses.create(model="tools", input=[{"role": "user", "content": "go"}], tools=[READ])
    outputs = [{"type": "function_call_output", "call_id": item.call_id, "output": "ok"}
               for item in first.output if item.type == "function_call"]
    server.client.responses.create(model="text", input=[{"role": "user", "content": "go"}, *first.output, *outputs],
                                   tools=[READ])
    messages = R.chat_request(server.received[-1])["messages"]
    assert messages == [{"role": "user", "content": "go"}, COMPLETIONS["tools"].choices[0].chat_message(),
                        _tool_message("call_r1", "ok"), _tool_message("call_r2", "ok")]
