"""The Anthropic Messages API (`POST /v1/messages`) over vime's one chat request.

`chat_request` turns a Messages request into an OpenAI chat request; `message_object` and `stream_events` render
a `Completion` as a Message and as its server-sent events; `error_body` is Anthropic's error shape. An assistant
turn we returned (text, then tool_use blocks) re-sent by the harness becomes exactly `ChoiceOut.chat_message()`:
the tool_use id is the call id and its input is re-serialized canonically, so the next call extends the recorded
conversation token for token.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vime.agents.api.completion import Completion, canonical_arguments

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_PIECES = 4  # text and tool input are streamed in this many deltas at most
# Anthropic's error type per HTTP status (its client picks the exception class by status, the type is for people).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 504: "timeout_error", 529: "overloaded_error"}


# ---- request -------------------------------------------------------------------------------------------------
def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Messages request asks for."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"'max_tokens' is required and must be a positive integer, got {max_tokens!r}")
    messages: list[dict[str, Any]] = []
    system = _text(body.get("system"), "system")
    if system:
        messages.append({"role": "system", "content": system})
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise ValueError("'messages' must be a non-empty list")
    for message in body["messages"]:
        messages += chat_messages(message)
    request: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    if body.get("tools"):
        request["tools"] = [chat_tool(t) for t in body["tools"]]
    if body.get("tool_choice") is not None:
        request["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("stop_sequences"):
        request["stop"] = list(body["stop_sequences"])
    if body.get("model") is not None:  # echoed in the answer, as the chat route does
        request["model"] = body["model"]
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            request[key] = body[key]
    if body.get("stream") is not None:
        request["stream"] = bool(body["stream"])
    return request


def chat_messages(message: Any) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user message's tool_result blocks become tool messages (in
    order), followed by its text as one user message."""
    role = message.get("role") if isinstance(message, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if role == "system":
        return [{"role": "system", "content": _text(content, "a system message")}]
    if role == "assistant":
        return [_assistant(content)]
    if role != "user":
        raise ValueError(f"a message's role must be user or assistant (or system), got {role!r}")
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, texts = [], []
    for block in _blocks(content, "a user message"):
        if block["type"] == "text":
            texts.append(block.get("text") or "")
        elif block["type"] == "tool_result":
            if not block.get("tool_use_id"):
                raise ValueError("a tool_result block needs the 'tool_use_id' of its tool_use")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _text(block.get("content"), "a tool_result")})
        else:
            raise _unsupported(block["type"], "a user message", "text, tool_result")
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(content: Any) -> dict[str, Any]:
    """An assistant message as ChoiceOut.chat_message() shapes our own answers: text ("" -> None), tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content or None}
    texts, calls = [], []
    for block in _blocks(content, "an assistant message"):
        if block["type"] == "text":
            texts.append(block.get("text") or "")
        elif block["type"] == "tool_use":
            if not block.get("id") or not block.get("name") or not isinstance(block.get("input"), dict):
                raise ValueError("a tool_use block needs 'id', 'name' and an 'input' object")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": canonical_arguments(block["input"])}})
        else:
            raise _unsupported(block["type"], "an assistant message", "text, tool_use")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list) or not content or not all(isinstance(b, dict) and b.get("type") for b in content):
        raise ValueError(f"the content of {where} must be a string or a list of typed content blocks")
    return content


def _text(content: Any, where: str) -> str:
    """The text of a string or a list of text blocks (system prompt, tool result); other blocks are refused."""
    if content is None or isinstance(content, str) or content == []:
        return content or ""
    pieces = []
    for block in _blocks(content, where):
        if block["type"] != "text":
            raise _unsupported(block["type"], where, "text")
        pieces.append(block.get("text") or "")
    return "".join(pieces)


def _unsupported(kind: str, where: str, served: str) -> ValueError:
    return ValueError(f"content blocks of type {kind!r} (in {where}) are not supported; this endpoint serves "
                      f"text only ({served})")


def chat_tool(tool: Any) -> dict[str, Any]:
    """A client tool ({name, description, input_schema}) as a chat tool; Anthropic's server tools are refused."""
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ValueError(f"tools of type {kind!r} are not supported: only client tools (name, description, "
                         "input_schema) are served")
    if not tool.get("name") or not isinstance(tool.get("input_schema"), dict):
        raise ValueError("a tool needs a 'name' and an 'input_schema' object")
    function = {"name": tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = tool["input_schema"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any) -> Any:
    """{"type": auto | any | tool | none, "name"} in the chat form ("any" is "required")."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind]
    if kind == "tool" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice {choice!r} is not supported; use {{'type': 'auto' | 'any' | 'none'}} or "
                     "{'type': 'tool', 'name': NAME}")


# ---- response ------------------------------------------------------------------------------------------------
def message_id(completion: Completion) -> str:
    """"msg_" and the completion id without its kind prefix: the streamed and the whole message agree."""
    return "msg_" + (re.sub(r"^[A-Za-z]+[-_]", "", completion.id) or completion.id)


def content_blocks(completion: Completion) -> list[dict[str, Any]]:
    """The first choice's text block (when it has text), then one tool_use block per call."""
    choice = completion.choices[0]
    blocks: list[dict[str, Any]] = [{"type": "text", "text": choice.text}] if choice.text else []
    blocks += [{"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}
               for call in choice.tool_calls]
    return blocks


def stop(completion: Completion) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the first choice."""
    choice = completion.choices[0]
    if choice.tool_calls:
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.stop_string:
        return "stop_sequence", choice.stop_string
    return "end_turn", None


def message_object(completion: Completion) -> dict[str, Any]:
    """The Message for the completion's first choice."""
    stop_reason, stop_sequence = stop(completion)
    usage = {"input_tokens": completion.prompt_tokens, "output_tokens": completion.choices[0].completion_tokens}
    return {"id": message_id(completion), "type": "message", "role": "assistant", "model": completion.model,
            "content": content_blocks(completion), "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "stop_details": None, "usage": usage}


def _pieces(text: str) -> list[str]:
    size = max(1, -(-len(text) // _PIECES))
    return [text[i:i + size] for i in range(0, len(text), size)]


def stream_events(completion: Completion) -> list[tuple[str, dict[str, Any]]]:
    """The server-sent events (name, data) of a streamed Message, in order; they accumulate into
    `message_object(completion)`."""
    final = message_object(completion)
    events: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, **data}))

    emit("message_start", message={**final, "content": [], "stop_reason": None, "stop_sequence": None,
                                   "usage": {"input_tokens": completion.prompt_tokens, "output_tokens": 0}})
    choice, index = completion.choices[0], 0
    if choice.text:
        emit("content_block_start", index=0, content_block={"type": "text", "text": ""})
        for piece in _pieces(choice.text):
            emit("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
        emit("content_block_stop", index=0)
        index = 1
    for offset, call in enumerate(choice.tool_calls):
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        emit("content_block_start", index=index + offset, content_block=block)
        for piece in _pieces(call.arguments):
            emit("content_block_delta", index=index + offset,
                 delta={"type": "input_json_delta", "partial_json": piece})
        emit("content_block_stop", index=index + offset)
    emit("message_delta", delta={"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"],
                                 "stop_details": None}, usage={"output_tokens": final["usage"]["output_tokens"]})
    emit("message_stop")
    return events


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status (other 4xx: invalid_request_error, other 5xx: api_error)."""
    kind = _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
