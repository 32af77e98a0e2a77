"""The message-prefix / token-delta logic of the OpenAI endpoint, without an engine."""

from __future__ import annotations

import pytest

from vime.agents.chat_session import (ChatSession, ChatTemplate, new_messages_after, normalize_messages,
                                      trajectory_to_sample)
from vime.agents.openai_replies import reply_text
from vime.agents.openai_requests import engine_sampling_params, session_id_of
from vime.data.sample import Sample


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def _turn(session, template, tokenizer, messages, sampled_text, eos=True):
    """One fake engine call: `sampled_text` (+ EOS) is what the model 'sampled'."""
    trajectory, prompt, normalized = session.prepare(messages, None, template)
    sampled = tokenizer.encode(sampled_text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
    log_probs = [-0.1 * (i + 1) for i in range(len(sampled))]
    text = reply_text(tokenizer, sampled, None)
    session.record(trajectory, prompt, normalized, sampled, log_probs, ["3"], "stop" if eos else "length",
                   {"role": "assistant", "content": text}, template)
    return prompt, sampled, log_probs, text


def test_normalize_and_prefix():
    prev = normalize_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " yo \n"}])
    assert prev[1] == {"role": "assistant", "content": "yo"}
    cur = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                              {"role": "assistant", "content": "yo", "refusal": None, "tool_calls": None},
                              {"role": "user", "content": "more"}])
    assert new_messages_after(prev, cur) == [{"role": "user", "content": "more"}]
    assert new_messages_after(prev, cur[:2]) is None  # nothing new
    edited = [cur[0], {"role": "assistant", "content": "other"}, cur[2]]
    assert new_messages_after(prev, edited) is None
    with pytest.raises(ValueError):
        normalize_messages([])


def test_multi_turn_is_token_exact(tokenizer):
    template = ChatTemplate(tokenizer)
    assert template.assistant_closing == "<|im_end|>\n"
    session = ChatSession("ep/main")
    m1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 3?"}]
    p1, s1, lp1, t1 = _turn(session, template, tokenizer, m1, "The answer is 5.")
    assert p1 == tokenizer.apply_chat_template(m1, add_generation_prompt=True, tokenize=True) or \
        p1 == tokenizer.encode(tokenizer.apply_chat_template(m1, add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False)
    assert t1 == "The answer is 5."
    m2 = m1 + [{"role": "assistant", "content": t1}, {"role": "user", "content": "Times 2?"}]
    p2, s2, lp2, t2 = _turn(session, template, tokenizer, m2, "10", eos=False)  # cut by length: no EOS
    # the second prompt is the recorded sequence followed by the template tokens of the new message only
    delta = tokenizer.encode("\n<|im_start|>user\nTimes 2?<|im_end|>\n<|im_start|>assistant\n",
                             add_special_tokens=False)
    assert p2 == p1 + s1 + delta
    # here a full re-rendering gives the same ids (a prefix-stable template, the model's own EOS)
    full = tokenizer.encode(tokenizer.apply_chat_template(m2, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    assert p2 == full
    m3 = m2 + [{"role": "assistant", "content": t2}, {"role": "user", "content": "ok"}]
    p3, s3, lp3, _ = _turn(session, template, tokenizer, m3, "bye")
    # no EOS after "10": the template's whole closing is added
    assert p3 == p2 + s2 + tokenizer.encode("<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n",
                                            add_special_tokens=False)

    (traj,) = session.trajectories
    assert traj.tokens == p3 + s3
    assert traj.prompt_length == len(p1)
    sampled_positions = [i for i, m in enumerate(traj.loss_mask) if m]
    expected = (list(range(len(p1), len(p1) + len(s1))) + list(range(len(p2), len(p2) + len(s2)))
                + list(range(len(p3), len(p3) + len(s3))))
    assert sampled_positions == expected
    assert [traj.tokens[i] for i in sampled_positions] == s1 + s2 + s3
    assert [traj.log_probs[i] for i in sampled_positions] == pytest.approx(lp1 + lp2 + lp3)
    assert all(traj.log_probs[i] == 0.0 for i in range(len(traj.tokens)) if not traj.loss_mask[i])
    assert [t["finish_reason"] for t in traj.turns] == ["stop", "length", "stop"]
    assert traj.weight_versions == [3]

    base = Sample(group_index=4, index=17, label="5", metadata={"k": 1})
    sample = trajectory_to_sample(traj, base, tokenizer, "main", "ep/main")
    assert sample.prompt_length == len(p1) and sample.response_length == len(traj.tokens) - len(p1)
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert sum(sample.loss_mask) == len(s1 + s2 + s3)
    assert sample.status == Sample.Status.COMPLETED
    assert (sample.group_index, sample.index, sample.label) == (4, 17, "5")
    assert sample.metadata["k"] == 1 and sample.metadata["agent_role"] == "main"
    assert Sample.from_dict(sample.to_dict()) == sample


def test_rewritten_history_starts_a_new_trajectory(tokenizer):
    template = ChatTemplate(tokenizer)
    session = ChatSession("s")
    m1 = [{"role": "user", "content": "hello"}]
    _turn(session, template, tokenizer, m1, "hi there")
    m2 = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "something else"},
          {"role": "user", "content": "again"}]
    p2, s2, _, _ = _turn(session, template, tokenizer, m2, "ok")
    assert len(session.trajectories) == 2
    second = session.trajectories[1]
    assert second.prompt_length == len(p2) and second.tokens == p2 + s2
    assert p2 == tokenizer.encode(tokenizer.apply_chat_template(m2, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)


def test_failed_call_records_nothing(tokenizer):
    template = ChatTemplate(tokenizer)
    session = ChatSession("s")
    session.prepare([{"role": "user", "content": "hello"}], None, template)  # the engine call then fails
    assert session.trajectories == []


def test_sampling_params_and_session_id():
    defaults = {"max_tokens": 32, "temperature": 1.0, "top_p": 1.0}
    p = engine_sampling_params({"temperature": 0.5, "max_tokens": 100, "stop": "\n", "top_p": 0.9}, defaults,
                               {"temperature": 0.8, "max_tokens": 24})
    assert p["temperature"] == 0.8 and p["max_tokens"] == 24 and p["stop"] == ["\n"] and p["top_p"] == 0.9
    assert p["logprobs"] == 0
    assert engine_sampling_params({}, defaults, {})["max_tokens"] == 32
    assert engine_sampling_params({"max_tokens": 8}, defaults, {"max_tokens": 24})["max_tokens"] == 8
    assert session_id_of({"X-Session-ID": "a", "Authorization": "Bearer b"}, {"user": "c"}) == "a"
    assert session_id_of({"Authorization": "Bearer b"}, {"user": "c"}) == "b"
    assert session_id_of({}, {"user": "c"}) == "c"
    assert session_id_of({}, {}) is None


def test_sampling_params_n_and_top_logprobs():
    defaults = {"max_tokens": 32}
    assert engine_sampling_params({"n": 4}, defaults, {})["n"] == 4
    assert "n" not in engine_sampling_params({"n": 1}, defaults, {})
    assert engine_sampling_params({"logprobs": True, "top_logprobs": 3}, defaults, {})["logprobs"] == 3
    for bad, match in (({"n": 0}, "n must be"), ({"n": 65}, "n must be"), ({"n": "2"}, "n must be"),
                       ({"top_logprobs": 2}, "needs logprobs"), ({"logprobs": True, "top_logprobs": 21}, "0 to 20")):
        with pytest.raises(ValueError, match=match):
            engine_sampling_params(bad, defaults, {})
    assert session_id_of({"x-api-key": "k"}, {"user": "c"}) == "k"  # the Anthropic client's header


def _tool_reply(tokenizer, text):
    from vime.agents.api.completion import ChoiceOut, ToolCallOut, canonical_arguments
    from vime.agents.tool_parsing import split_tool_calls

    content, calls = split_tool_calls(text)
    return ChoiceOut(0, content, [ToolCallOut(f"call_{i}", c.name, canonical_arguments(c.arguments))
                                  for i, c in enumerate(calls)], "tool_calls" if calls else "stop")


def test_tool_calls_returned_and_resent_extend_the_trajectory(tokenizer):
    """A tool-call reply goes back to the harness structured; the harness re-sends it (arguments re-serialized
    in another key order, extra fields, content None) with the tool result: the call still extends the one
    recorded token sequence, whose sampled tokens are the tool-call text as the model wrote it."""
    template = ChatTemplate(tokenizer)
    session = ChatSession("ep/tools")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    m1 = [{"role": "user", "content": "add 2 3"}]
    trajectory, prompt, normalized = session.prepare(m1, tools, template)
    assert "# Tools" in tokenizer.decode(prompt)  # the tools reached the model through its template
    text = 'ok <tool_call>{"name": "add", "arguments": {"b": 3, "a": 2}}</tool_call>'
    sampled = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    reply = _tool_reply(tokenizer, text)
    assert reply.text == "ok" and reply.tool_calls[0].arguments == '{"a": 2, "b": 3}'
    session.record(trajectory, prompt, normalized, sampled, [-0.1] * len(sampled), ["1"], "stop",
                   reply.chat_message(), template)
    resent = {"role": "assistant", "content": "ok", "refusal": None, "audio": None,
              "tool_calls": [{"id": "call_0", "type": "function",
                              "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}]}
    m2 = m1 + [resent, {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    same, prompt2, _ = session.prepare(m2, tools, template)
    assert same is trajectory and prompt2[:len(prompt) + len(sampled)] == prompt + sampled
    assert tokenizer.decode(prompt2[len(prompt) + len(sampled):]) == \
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_forty_turn_history_renders_in_time_linear_in_the_turns(tokenizer):
    """A harness that re-sends its whole history each call: only the new messages are rendered, so the 40th
    call's preparation costs no more than 3x the 5th's (a re-rendering of the history would cost ~8x)."""
    import time

    template = ChatTemplate(tokenizer)
    session = ChatSession("ep/long")
    words = " ".join(["the answer is five and the next one is six"] * 20)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": words}]
    seconds = {}
    for turn in range(1, 41):
        timings = []
        for _ in range(3):  # prepare records nothing: the best of three is the cost without noise
            start = time.perf_counter()
            trajectory, prompt, normalized = session.prepare(messages, None, template)
            timings.append(time.perf_counter() - start)
        seconds[turn] = min(timings)
        reply = f"turn {turn}: {words}"
        sampled = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        session.record(trajectory, prompt, normalized, sampled, [-0.1] * len(sampled), ["1"], "stop",
                       {"role": "assistant", "content": reply}, template)
        messages = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": words}]
    assert len(session.trajectories) == 1 and len(session.trajectories[0].turns) == 40
    assert seconds[40] <= 3 * seconds[5], seconds
    full_render = min(_timed(lambda: template.prompt_ids(messages)) for _ in range(3))
    assert full_render > 3 * seconds[40], (full_render, seconds[40])  # the test can tell the two apart


def _timed(fn) -> float:
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
