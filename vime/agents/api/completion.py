"""What one chat call produced, independent of the API it was asked through.

Every API route of the endpoint (chat completions, Responses, Anthropic Messages) turns its request into one
OpenAI-style chat request (messages, tools, sampling fields), runs it, and renders the `Completion` below in
its own format. Tool calls carry canonical JSON arguments (`canonical_arguments`): a harness that re-sends a
call, in whichever format, re-sends the same string, so its history still extends the recorded one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def canonical_arguments(arguments: dict[str, Any]) -> str:
    """A tool call's arguments as the one JSON string every route returns and expects back (keys sorted: a
    harness that rebuilds the object in another order still sends the same string)."""
    return json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "), sort_keys=True)


@dataclass
class ToolCallOut:
    """A parsed tool call as returned to the client."""

    id: str  # "call_<hex>"; Anthropic's tool_use id and the Responses API's call_id are this same string
    name: str
    arguments: str  # canonical_arguments(...) of the parsed arguments object

    def chat_dict(self) -> dict[str, Any]:
        """The OpenAI chat form, as in an assistant message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ChoiceOut:
    """One sampled answer."""

    index: int
    text: str  # the reply's content, tool-call markup removed ("" when the turn is only tool calls)
    tool_calls: list[ToolCallOut] = field(default_factory=list)
    finish_reason: str = "stop"  # OpenAI's: "stop", "length" or "tool_calls"
    stop_string: str | None = None  # the request's stop string that ended the answer, if one did
    completion_tokens: int = 0
    # Per sampled token, when the request asked for log-probs: {"token", "logprob", "bytes", "top_logprobs":
    # [{"token", "logprob", "bytes"}, ...]} (OpenAI's chat logprobs content entries).
    logprobs: list[dict[str, Any]] | None = None
    # The text in the pieces a stream sends (one per sampled token where they decode apart); None: in one piece.
    pieces: list[str] | None = None

    def chat_message(self) -> dict[str, Any]:
        """The assistant message this answer adds to the conversation, in OpenAI chat form (what a harness
        re-sends, and what the Responses API's previous_response_id continues from)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.tool_calls:
            message["tool_calls"] = [call.chat_dict() for call in self.tool_calls]
        return message


@dataclass
class Completion:
    id: str  # unique per call; the Responses API stores it for previous_response_id
    model: str
    created: int  # unix seconds
    prompt_tokens: int
    choices: list[ChoiceOut]

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)
