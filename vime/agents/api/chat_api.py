"""OpenAI chat completions: the response object and its server-sent-event chunks for one `Completion`.

A streamed answer is sent once the engine has finished it (the engine call is one token-in/token-out request):
the chunks carry the same text, tool calls and usage as the non-streamed object, so a harness that streams
sees, and trains on, exactly what it would have seen without streaming.
"""

from __future__ import annotations

from typing import Any

from vime.agents.api.completion import ChoiceOut, Completion


def completion_object(completion: Completion) -> dict[str, Any]:
    return {
        "id": completion.id, "object": "chat.completion", "created": completion.created, "model": completion.model,
        "choices": [{"index": c.index, "message": {**c.chat_message(), "refusal": None},
                     "finish_reason": c.finish_reason,
                     "logprobs": {"content": c.logprobs, "refusal": None} if c.logprobs is not None else None}
                    for c in completion.choices],
        "usage": usage(completion),
    }


def usage(completion: Completion) -> dict[str, int]:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens}


def stream_chunks(completion: Completion, include_usage: bool) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a streamed answer, in order: per choice its role, its content in
    its `pieces` (or whole), its tool calls, its finish reason; then, when the request asked for it
    (stream_options.include_usage), a usage chunk."""
    def chunk(choices: list[dict[str, Any]], **extra) -> dict[str, Any]:
        return {"id": completion.id, "object": "chat.completion.chunk", "created": completion.created,
                "model": completion.model, "choices": choices, **extra}

    out = []
    for c in completion.choices:
        out.append(chunk([_delta(c, {"role": "assistant", "content": ""})]))
        text_pieces = c.pieces if c.pieces is not None else ([c.text] if c.text else [])
        if "".join(text_pieces) != c.text:
            raise ValueError("the streamed pieces do not join to the answer's text")
        logprobs = c.logprobs or []
        for k, piece in enumerate(text_pieces):
            # Log-probs ride on the content chunks: all of them on the last one when pieces do not match tokens.
            entry = logprobs if k == len(text_pieces) - 1 else []
            out.append(chunk([_delta(c, {"content": piece}, entry if c.logprobs is not None else None)]))
        if c.tool_calls:
            out.append(chunk([_delta(c, {"tool_calls": [{"index": i, **call.chat_dict()}
                                                        for i, call in enumerate(c.tool_calls)]})]))
        out.append(chunk([{**_delta(c, {}), "finish_reason": c.finish_reason}]))
    if include_usage:
        out.append(chunk([], usage=usage(completion)))
    return out


def _delta(choice: ChoiceOut, delta: dict[str, Any], logprobs: list | None = None) -> dict[str, Any]:
    return {"index": choice.index, "delta": delta, "finish_reason": None,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}
