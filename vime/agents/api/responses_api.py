"""The OpenAI Responses API (`POST /v1/responses`), the subset agent SDKs use, over vime's one chat request.

`chat_request` turns a Responses request (plus the chat messages of the response its previous_response_id names)
into an OpenAI chat request; `response_object` and `stream_events` render a `Completion` as a Response and as its
server-sent events. A harness that re-sends our output as input items (a message item, then function_call items)
gets back exactly `ChoiceOut.chat_message()`, so its next call extends the recorded conversation token for token.
Only function tools are served: the hosted tools (web search, file search, ...) have no engine behind them.
"""

from __future__ import annotations

import re
from typing import Any

from vime.agents.api.completion import ChoiceOut, Completion, canonical_arguments
from vime.agents.tool_parsing import loads_bounded

_TEXT_PARTS = ("input_text", "output_text")  # the content parts whose text a chat template can render
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TOOL_CHOICES = ("auto", "none", "required")
_PIECES = 4  # text and arguments are streamed in this many deltas at most


# ---- request -------------------------------------------------------------------------------------------------
def chat_request(body: dict[str, Any], previous_messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat request a Responses request asks for. `previous_messages`: the chat messages (answer included)
    of the response named by previous_response_id, which this request continues."""
    messages = [dict(m) for m in previous_messages or []]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError(f"'instructions' must be a string, got {type(instructions).__name__}")
    if instructions:
        if messages and messages[0].get("role") == "system":  # the new instructions replace the previous ones
            messages = messages[1:]
        messages.insert(0, {"role": "system", "content": instructions})
    messages += input_messages(body.get("input"))
    request: dict[str, Any] = {"messages": messages}
    if body.get("tools"):
        request["tools"] = [chat_tool(t) for t in body["tools"]]
    if body.get("tool_choice") is not None:
        request["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        request["max_tokens"] = body["max_output_tokens"]
    if body.get("model") is not None:  # echoed in the answer, as the chat route does
        request["model"] = body["model"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            request[key] = body[key]
    if body.get("stream") is not None:
        request["stream"] = bool(body["stream"])
    return request


def input_messages(input_: Any) -> list[dict[str, Any]]:
    """Chat messages of a request's `input`: a string (one user message) or a list of input items."""
    if isinstance(input_, str) and input_:
        return [{"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise ValueError("'input' must be a non-empty string or a non-empty list of input items")
    messages: list[dict[str, Any]] = []
    extends = False  # whether a function_call item joins the last message (one assistant turn, as we return it)
    for item in input_:
        if not isinstance(item, dict):
            raise ValueError(f"an input item must be an object, got {item!r}")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item))
            extends = messages[-1]["role"] == "assistant"
        elif kind == "function_call":
            call = _tool_call(item)
            if extends:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            extends = True
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise ValueError("a function_call_output item needs the 'call_id' of its function_call")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), "function_call_output")})
            extends = False
        elif kind == "reasoning":  # the policy's own reasoning is not replayed: our output never carries any
            continue
        else:
            raise ValueError(f"input items of type {kind!r} are not supported; send message, function_call, "
                             "function_call_output (and reasoning) items")
    return messages


def _message(item: dict[str, Any]) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise ValueError(f"a message item's role must be user, system, developer or assistant, "
                         f"got {item.get('role')!r}")
    text = _text(item.get("content"), f"a {item.get('role')} message")
    if role == "assistant":  # as ChoiceOut.chat_message() shapes our own answers
        return {"role": "assistant", "content": text or None}
    return {"role": role, "content": text}


def _text(content: Any, where: str) -> str:
    """The text of a string or a list of text parts; any other part is refused, not dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"the content of {where} must be a string or a list of parts")
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ValueError(f"content parts of type {kind!r} (in {where}) are not supported; "
                             "this endpoint serves text only (input_text, output_text)")
        pieces.append(part.get("text") or "")
    return "".join(pieces)


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    """A function_call item as a chat tool call; JSON-object arguments re-serialized the one canonical way."""
    if not item.get("call_id") or not item.get("name"):
        raise ValueError("a function_call item needs 'call_id' and 'name'")
    arguments = item.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = loads_bounded(arguments)
        except ValueError:  # not JSON, or nested too deep to re-serialize: kept as the string it is
            parsed = None
        if isinstance(parsed, dict):
            arguments = canonical_arguments(parsed)
    elif isinstance(arguments, dict):
        arguments = canonical_arguments(arguments)
    else:
        raise ValueError("a function_call item's 'arguments' must be a JSON string")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}


def chat_tool(tool: Any) -> dict[str, Any]:
    """A Responses function tool as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ValueError(f"tools of type {kind!r} are not supported: only function tools are served "
                         "({'type': 'function', 'name', 'description', 'parameters'})")
    if not tool.get("name"):
        raise ValueError("a function tool needs a 'name'")
    function = {"name": tool["name"]}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any) -> Any:
    """"auto" / "none" / "required" / {"type": "function", "name": N} in the chat form."""
    if choice in _TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice {choice!r} is not supported; use 'auto', 'none', 'required' or "
                     "{'type': 'function', 'name': NAME}")


# ---- response ------------------------------------------------------------------------------------------------
def _id_tail(completion_id: str) -> str:
    """The completion id without its kind prefix ("resp_", "chatcmpl-"): item ids are built from it, so the
    streamed and the whole response name the same items."""
    return re.sub(r"^[A-Za-z]+[-_]", "", completion_id) or completion_id


def message_item_id(completion: Completion) -> str:
    return f"msg_{_id_tail(completion.id)}"


def function_call_item_id(completion: Completion, index: int) -> str:
    return f"fc_{_id_tail(completion.id)}_{index}"


def output_items(completion: Completion) -> list[dict[str, Any]]:
    """The finished output items of the completion's first choice: its text as a message, then its calls."""
    choice = completion.choices[0]
    items: list[dict[str, Any]] = []
    if choice.text:
        items.append({"id": message_item_id(completion), "type": "message", "role": "assistant",
                      "status": "incomplete" if _truncated(choice) else "completed",
                      "content": [_text_part(choice.text)]})
    for i, call in enumerate(choice.tool_calls):
        items.append({"id": function_call_item_id(completion, i), "type": "function_call", "call_id": call.id,
                      "name": call.name, "arguments": call.arguments, "status": "completed"})
    return items


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _truncated(choice: ChoiceOut) -> bool:
    return choice.finish_reason == "length"


def response_object(completion: Completion, body: dict[str, Any]) -> dict[str, Any]:
    """The Response for the completion's first choice; `body` (the request) gives the fields a Response echoes."""
    choice = completion.choices[0]
    response = _response_shell(completion, body)
    response.update({
        "status": "incomplete" if _truncated(choice) else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if _truncated(choice) else None,
        "output": output_items(completion),
        "usage": {"input_tokens": completion.prompt_tokens,
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": choice.completion_tokens,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": completion.prompt_tokens + choice.completion_tokens},
    })
    return response


def _response_shell(completion: Completion, body: dict[str, Any]) -> dict[str, Any]:
    """A Response still in progress: no output, no usage. The request's `user` is not echoed: it may be the
    session id, the episode's credential."""
    return {
        "id": completion.id, "object": "response", "created_at": completion.created, "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": completion.model, "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "reasoning": None,
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto", "tools": [_echo_tool(t) for t in body.get("tools") or []],
        "truncation": body.get("truncation") or "disabled", "metadata": body.get("metadata") or {}, "usage": None,
    }


def _echo_tool(tool: Any) -> Any:
    """A request's function tool as a Response lists it (parameters and strict always present)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def _pieces(text: str) -> list[str]:
    """`text` in at most _PIECES non-empty deltas."""
    size = max(1, -(-len(text) // _PIECES))
    return [text[i:i + size] for i in range(0, len(text), size)]


def stream_events(completion: Completion, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The server-sent events (name, data) of a streamed Response, in order; the last one carries
    `response_object(completion, body)`, so the streamed and the whole response agree."""
    final = response_object(completion, body)
    events: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **data}))

    emit("response.created", response=_response_shell(completion, body))
    emit("response.in_progress", response=_response_shell(completion, body))
    for index, item in enumerate(final["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                           "content": []})
            text = item["content"][0]["text"]
            emit("response.content_part.added", **where, content_index=0, part=_text_part(""))
            for piece in _pieces(text):
                emit("response.output_text.delta", **where, content_index=0, delta=piece, logprobs=[])
            emit("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            emit("response.content_part.done", **where, content_index=0, part=_text_part(text))
        else:
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                           "arguments": ""})
            for piece in _pieces(item["arguments"]):
                emit("response.function_call_arguments.delta", **where, delta=piece)
            emit("response.function_call_arguments.done", **where, arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit(f"response.{final['status']}", response=final)
    return events
