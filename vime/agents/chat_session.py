"""One agent conversation as the policy saw it: the exact token ids, which of them the policy sampled, their
log-probs and weight versions, across turns. Pure logic, no HTTP (the OpenAI endpoint drives it).

Token exactness: when a chat call's messages extend the previous call's messages plus the reply we returned,
the new prompt is the recorded sequence (earlier prompt + exactly the sampled tokens) followed by the
chat-template tokens of the new messages only; earlier model output is never re-tokenized. Otherwise (the
harness rewrote history) a new trajectory starts from a fresh rendering of the whole conversation.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

from vime.agents.api.completion import canonical_arguments
from vime.agents.tool_parsing import loads_bounded
from vime.data.sample import Sample
from vime.data.weight_versions import add_spans, add_versions, shift_spans

logger = logging.getLogger(__name__)

_FINISH_STATUS = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED}
_SENTINEL = "VIMESENTINEL7319"  # a reply text no template contains: marks where assistant content ends


def _content_text(content: Any) -> str:
    """OpenAI content: a string, None, or a list of parts; the text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """The fields of a chat message that a template renders, None and empty ones dropped. Assistant text is
    stripped so that a harness that trims whitespace still extends the conversation."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"a chat message must be an object with a 'role', got {message!r}")
    out: dict[str, Any] = {"role": message["role"], "content": _content_text(message.get("content"))}
    if out["role"] == "assistant":
        out["content"] = out["content"].strip()
    for key in ("name", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [_canonical_tool_call(call) for call in message["tool_calls"]]
    return out


def _canonical_tool_call(call: Any) -> dict[str, Any]:
    """The fields of a tool call a template renders, arguments as canonical JSON: a harness that re-sends our
    call with its arguments re-serialized (or as an object) still extends the recorded conversation."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError(f"a tool call must be an object with a 'function' object, got {call!r}")
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = loads_bounded(arguments)
        except ValueError:  # not JSON, or nested too deep to re-serialize: kept as the string it is
            parsed = None
        arguments = canonical_arguments(parsed) if isinstance(parsed, dict) else arguments
    elif isinstance(arguments, dict):
        arguments = canonical_arguments(arguments)
    return {"id": call.get("id"), "type": "function",
            "function": {"name": call["function"].get("name"), "arguments": arguments}}


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    return [normalize_message(m) for m in messages]


def new_messages_after(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages `current` adds after `previous`, or None when it does not extend it (normalized input)."""
    if not previous or len(current) <= len(previous):
        return None
    if current[: len(previous)] != previous:  # normalized dicts: equal when every rendered field is
        return None
    return current[len(previous):]


class ChatTemplate:
    """Prompt token ids from chat messages, whole or as the delta after a recorded assistant turn."""

    def __init__(self, tokenizer, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.kwargs = dict(template_kwargs or {})
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
        self._base = base
        base_text = self.render(base, add_generation_prompt=False)
        # What the template writes after an assistant message's content (ChatML: "<|im_end|>\n").
        self.assistant_closing = base_text[base_text.rindex(_SENTINEL) + len(_SENTINEL):]

    def render(self, messages: list[dict[str, Any]], tools: list | None = None,
               add_generation_prompt: bool = True, tool_choice: Any = None) -> str:
        """The template's text; `tool_choice` reaches templates that render it (a variable they may ignore)."""
        extra = {"tool_choice": tool_choice} if tool_choice is not None else {}
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **extra,
                                                  **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list | None = None,
                   tool_choice: Any = None) -> list[int]:
        """A whole conversation, ending with the generation prompt."""
        return self.encode(self.render(messages, tools, tool_choice=tool_choice))

    def delta_ids(self, new_messages: list[dict[str, Any]], tools: list | None, closed_text: str,
                  tool_choice: Any = None) -> list[int]:
        """Tokens that follow a recorded assistant turn: the rest of the template's closing of that turn (the
        part the model did not generate itself, given as `closed_text`), the new messages and the generation
        prompt."""
        base_text = self.render(self._base, tools, add_generation_prompt=False, tool_choice=tool_choice)
        full = self.render(self._base + new_messages, tools, tool_choice=tool_choice)
        if not full.startswith(base_text):
            raise ValueError("the chat template renders earlier messages differently once new ones follow; "
                             "token-exact multi-turn needs a prefix-stable template")
        closing = self.assistant_closing
        rest_of_closing = closing[len(closed_text):] if closed_text and closing.startswith(closed_text) else closing
        return self.encode(rest_of_closing + full[len(base_text):])

    def closed_text(self, sampled: list[int], finish_reason: str | None) -> str:
        """The text of the turn's closing that the model produced itself: its final special token (e.g. EOS
        `<|im_end|>`) when it stopped on it and the template's closing starts with it; "" otherwise."""
        if finish_reason != "stop" or not sampled or sampled[-1] not in set(self.tokenizer.all_special_ids):
            return ""
        text = self.tokenizer.decode([sampled[-1]], skip_special_tokens=False)
        return text if self.assistant_closing.startswith(text) else ""


@dataclass
class Trajectory:
    """One token sequence: the first prompt, then sampled tokens and template tokens interleaved.

    `loss_mask` and `log_probs` have one entry per token: 1 / the engine's log-prob for tokens the policy
    sampled, 0 / 0.0 for everything else (prompt, other messages, template glue)."""

    prompt_length: int = 0
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # normalized, incl. the last reply
    prompt_messages: list[dict[str, Any]] = field(default_factory=list)  # the first call's messages
    weight_versions: list[int] = field(default_factory=list)
    weight_version_spans: list[list] = field(default_factory=list)  # over `tokens` (vime.data.weight_versions)
    turns: list[dict[str, Any]] = field(default_factory=list)
    closed_text: str = ""  # what of the template's closing the last reply already contains

    def add_context(self, token_ids: list[int]) -> None:
        self.tokens += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.log_probs += [0.0] * len(token_ids)

    def add_sampled(self, token_ids: list[int], log_probs: list[float], weight_versions: list) -> None:
        """`weight_versions`: the engine's spans over these tokens (or bare version labels)."""
        if len(token_ids) != len(log_probs):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(log_probs)} log-probs")
        add_spans(self.weight_version_spans, weight_versions, len(self.tokens), len(token_ids))
        add_versions(self.weight_versions, weight_versions)
        self.tokens += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.log_probs += [float(x) for x in log_probs]

    @property
    def finish_reason(self) -> str | None:
        return self.turns[-1]["finish_reason"] if self.turns else None


def branch(trajectory: Trajectory) -> Trajectory:
    """A copy of `trajectory` that one of a call's other answers (n > 1) extends: each answer is its own sample."""
    return copy.deepcopy(trajectory)


def _role(session_id: str) -> str:
    """What a log line may say about a session: its role, never its episode token (a credential)."""
    return repr(session_id.split("/", 1)[1]) if "/" in session_id else "(main)"


@dataclass
class ChatSession:
    """All chat calls made with one session id, as one or more trajectories."""

    session_id: str
    trajectories: list[Trajectory] = field(default_factory=list)

    def prepare(self, messages: list[dict[str, Any]], tools: list | None, template: ChatTemplate,
                tool_choice: Any = None) -> tuple[Trajectory, list[int], list[dict[str, Any]]]:
        """(trajectory to extend, prompt token ids for the engine, normalized messages). Records nothing:
        `record` does once the engine answered, so a failed call leaves the session unchanged.

        The call extends the latest trajectory whose recorded conversation its messages continue (with n > 1 a
        harness continues one of the answers): only the new messages are rendered, so a long re-sent history
        costs one comparison, not a re-rendering. Otherwise a new trajectory starts from the whole conversation."""
        normalized = normalize_messages(messages)
        for trajectory in reversed(self.trajectories):
            new = new_messages_after(trajectory.messages, normalized)
            if new is not None:
                delta = template.delta_ids(new, tools, trajectory.closed_text, tool_choice)
                return trajectory, trajectory.tokens + delta, normalized
        if self.trajectories:
            logger.info("agent session %s: the messages do not continue any recorded turn (history edited or "
                        "re-sent without the last answer); a new trained trajectory starts", _role(self.session_id))
        fresh = Trajectory(prompt_messages=normalized)
        return fresh, template.prompt_ids(normalized, tools, tool_choice), normalized

    def record(self, trajectory: Trajectory, prompt_ids: list[int], messages: list[dict[str, Any]],
               sampled: list[int], log_probs: list[float], weight_versions: list, finish_reason: str | None,
               assistant_message: dict[str, Any], template: ChatTemplate) -> None:
        """Add one answer to `trajectory` (a trajectory `prepare` returned, or a `branch` of one)."""
        if not trajectory.tokens:  # a new trajectory: the whole prompt is its prompt
            trajectory.prompt_length = len(prompt_ids)
        if not any(t is trajectory for t in self.trajectories):
            self.trajectories.append(trajectory)
        if prompt_ids[: len(trajectory.tokens)] != trajectory.tokens:
            raise AssertionError("prompt does not extend the recorded tokens")  # a bug, never user input
        trajectory.add_context(prompt_ids[len(trajectory.tokens):])
        trajectory.add_sampled(sampled, log_probs, weight_versions)
        trajectory.messages = messages + [normalize_message(assistant_message)]
        trajectory.closed_text = template.closed_text(sampled, finish_reason)
        trajectory.turns.append({"prompt_tokens": len(prompt_ids), "completion_tokens": len(sampled),
                                 "finish_reason": finish_reason})


def trajectory_to_sample(trajectory: Trajectory, base: Sample, tokenizer, role: str, session_id: str) -> Sample:
    """A trainable Sample: prompt = the first call's prompt tokens, response = everything after it, with the
    loss mask and log-probs of the response part. Keeps `base`'s identity (group, index, label, metadata)."""
    p = trajectory.prompt_length
    response_tokens = trajectory.tokens[p:]
    return Sample(
        group_index=base.group_index, index=base.index, prompt=trajectory.prompt_messages,
        tokens=list(trajectory.tokens), response=tokenizer.decode(response_tokens, skip_special_tokens=False),
        response_length=len(response_tokens), label=base.label, loss_mask=trajectory.loss_mask[p:],
        rollout_log_probs=trajectory.log_probs[p:],
        status=_FINISH_STATUS.get(trajectory.finish_reason, Sample.Status.COMPLETED),
        metadata={**base.metadata, "agent_role": role, "agent_session": session_id,
                  "agent_turns": list(trajectory.turns)},
        weight_versions=list(trajectory.weight_versions),
        weight_version_spans=shift_spans(trajectory.weight_version_spans, p), tools=base.tools,
    )
