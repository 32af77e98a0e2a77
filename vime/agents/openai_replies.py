"""What a client of the OpenAI-compatible endpoint gets back: each engine answer as the client sees it (the text
without special tokens, cut at a stop string, its tool calls parsed out, log-probs in OpenAI's form, the pieces a
stream sends) and the HTTP responses (server-sent events, OpenAI-style errors, 401 without an open episode).
The trained tokens are the ones the engine sampled, whatever is shown: nothing here re-tokenizes.
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any

from aiohttp import web

from vime.agents.api.completion import ChoiceOut, ToolCallOut, canonical_arguments
from vime.agents.openai_requests import SESSION_HEADER
from vime.agents.tool_parsing import split_tool_calls


def client_answers(tokenizer, choices: list[dict[str, Any]], params: dict[str, Any], call_format: str | None,
                   with_logprobs: bool) -> list[ChoiceOut]:
    """What the client sees of each engine answer: its text, its tool calls (parsed in `call_format` when
    the request had tools), the finish reason, and the log-probs it asked for."""
    out = []
    for index, choice in enumerate(choices):
        sampled = list(choice.get("token_ids") or [])
        text = reply_text(tokenizer, sampled, params.get("stop"))
        content, calls = split_tool_calls(text, call_format) if call_format else (text, [])
        finish = "length" if choice.get("finish_reason") == "length" else ("tool_calls" if calls else "stop")
        stop = choice.get("stop_reason")
        entries = (choice.get("logprobs") or {}).get("content") or []
        answer = ChoiceOut(
            index=index, text=content, finish_reason=finish, completion_tokens=len(sampled),
            tool_calls=[ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", c.name, canonical_arguments(c.arguments))
                        for c in calls],
            stop_string=stop if isinstance(stop, str) else None,
            logprobs=openai_logprobs(tokenizer, entries, params["logprobs"]) if with_logprobs else None)
        answer.pieces = text_pieces(tokenizer, sampled, content) if not calls else [content] * bool(content)
        out.append(answer)
    return out


def reply_text(tokenizer, sampled: list[int], stop: list[str] | None) -> str:
    """What the client sees: the sampled text without special tokens, cut before a stop string (OpenAI)."""
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    for s in stop or []:
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    return text


def text_pieces(tokenizer, sampled: list[int], text: str) -> list[str]:
    """The answer's text as one piece per sampled token, for streaming, when the text is the plain decoding of
    the tokens (else the whole text as one piece: tool-call markup or a stop string was cut out of it)."""
    pieces, previous = [], ""
    for i in range(1, len(sampled) + 1):
        current = tokenizer.decode(sampled[:i], skip_special_tokens=True)
        if not current.startswith(previous) or "\ufffd" in current[len(previous):]:
            continue  # a token that completes a multi-byte character: its text comes with the next one
        if current != previous:
            pieces.append(current[len(previous):])
        previous = current
    return pieces if "".join(pieces) == text else ([text] if text else [])


def openai_logprobs(tokenizer, entries: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """The engine's per-token log-probs (token ids; the sampled token first, then candidates by rank) in
    OpenAI's chat form: token text, log-prob, UTF-8 bytes and the `top` best alternatives."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    out = []
    for entry in entries:
        ranked = sorted(entry.get("top_logprobs") or [], key=lambda c: (c.get("rank") or 0))
        alternatives, seen = [], set()
        for candidate in ranked:
            if candidate["token_id"] not in seen and len(alternatives) < top:
                seen.add(candidate["token_id"])
                alternatives.append(one(candidate["token_id"], candidate["logprob"]))
        out.append({**one(entry["token_id"], entry["logprob"]), "top_logprobs": alternatives})
    return out


def unauthorized(error=None) -> web.Response:
    """401 in the route's error shape (`error`, default OpenAI's): a session id without an open episode."""
    return (error or error_response)(401, "no open episode for this session id: use the session id the harness gave "
                                          "this episode's agent (or it + '/ROLE'), and only until the episode ends",
                                     "invalid_api_key")


def no_session_id(error=None, unread_over: int | None = None) -> web.Response:
    """401 for a call that names no session: in the headers, nor in a body's `user` (`unread_over`: in the headers,
    and its body was too long to read without one)."""
    unread = f" in the headers, and a body over {unread_over} bytes is not read without one" if unread_over else ""
    return (error or error_response)(401, f"no session id{unread}: set the API key to the episode's session id "
                                          f"(openai.OpenAI(base_url=..., api_key=SESSION_ID)) or the {SESSION_HEADER} "
                                          "header", "invalid_api_key")


def too_large(error, limit: int) -> web.Response:
    return (error or error_response)(413, f"the request body is over the endpoint's limit of {limit} bytes; raise "
                                          "--agent-endpoint-max-request-mb or send less")


def busy(error, limit: int) -> web.Response:
    """503 while the endpoint serves its limit of calls; the openai client retries it after Retry-After."""
    response = (error or error_response)(503, f"the endpoint is serving its limit of {limit} calls at once; retry")
    response.headers["Retry-After"] = "1"
    return response


def within_slots(route):
    """An API route method, `route(self, request, run, error)`, served while `self.slots` (a `CallSlots`) has
    room and answered `busy` beyond it, before anything of the request is read."""
    @functools.wraps(route)
    async def bounded(self, request: web.Request, run, error) -> web.StreamResponse:
        if not self.slots.take():
            return busy(error, self.slots.limit)
        try:
            return await route(self, request, run, error)
        finally:
            self.slots.give_back()

    return bounded


async def send_events(request: web.Request, events: list[tuple[str | None, dict[str, Any]]],
                      done_marker: bool = False) -> web.StreamResponse:
    """Server-sent events: `event: NAME` lines where the API names its events (Responses, Anthropic), then
    each event's JSON; OpenAI chat streams end with `data: [DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        await response.write(f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
    if done_marker:
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def error_response(status: int, message: str, code: str | int | None = None) -> web.Response:
    """An OpenAI-style error body (the openai client raises it as BadRequestError, AuthenticationError, ...)."""
    kind = "invalid_request_error" if status < 500 else "api_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": status if code is None else code}}, status=status)
