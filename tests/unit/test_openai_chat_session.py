"""The message-prefix / token-delta logic of the OpenAI endpoint, without an engine."""

from __future__ import annotations

import pytest

from vime.agents.chat_session import (ChatSession, ChatTemplate, new_messages_after, normalize_messages,
                                      trajectory_to_sample)
from vime.agents.openai_server import engine_sampling_params, reply_text, session_id_of
from vime.utils.types import Sample


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
    session.record(trajectory, prompt, normalized, sampled, log_probs, ["3"], "stop" if eos else "length", text,
                   template)
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
    assert traj.weight_versions == ["3"]

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
