"""multi_turn.generate around a scripted engine: turn layout, masks, log-probs, limits, no re-tokenization.

The engine is faked here (only the code around it is under test); tests/e2e/test_multi_turn_e2e.py runs the
same loop against real vLLM.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from vime.agents import multi_turn
from vime.data.sample import Sample
from vime.rollout.vllm_rollout import GenerateState


@pytest.fixture()
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    GenerateState.reset()
    yield AutoTokenizer.from_pretrained(tiny_qwen3)
    GenerateState.reset()


def _args(tiny_qwen3, **kw):
    return SimpleNamespace(hf_checkpoint=str(tiny_qwen3), rollout_concurrency=4, custom_generate_function_path=None,
                           **kw)


def _char_ids(tokenizer, text):
    """A deliberately non-canonical tokenization: one token per character, as a sampler may produce."""
    return [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c)[0]) for c in text]


class ScriptedEngine:
    def __init__(self, tokenizer, turns, eos=True):
        self.tokenizer, self.turns, self.eos, self.requests, self.models = tokenizer, list(turns), eos, [], []

    async def __call__(self, args, token_ids, params, model="policy"):
        self.requests.append((list(token_ids), dict(params)))
        self.models.append(model)
        ids = _char_ids(self.tokenizer, self.turns.pop(0)) + ([self.tokenizer.eos_token_id] if self.eos else [])
        ids = ids[:params["max_tokens"]]
        finish = "length" if len(ids) == params["max_tokens"] and not self.eos else "stop"
        return {"token_ids": ids, "logprobs": {"content": [{"logprob": -0.1 * (i + 1)} for i in range(len(ids))]},
                "finish_reason": finish, "weight_versions": ["3"]}


def _prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 6 * 7?"}], tokenize=False,
                                         add_generation_prompt=True)
    return Sample(index=0, prompt=text, tokens=tokenizer(text, add_special_tokens=False)["input_ids"])


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'


def _generate(monkeypatch, tiny_qwen3, engine, sample, max_tokens=400, **kw):
    monkeypatch.setattr(multi_turn, "post_generate", engine)
    params = {"max_tokens": max_tokens, "temperature": 1.0, "logprobs": 0}
    return asyncio.run(multi_turn.generate(_args(tiny_qwen3), sample, params, **kw))


def test_tool_turn_is_masked_and_sampled_ids_are_kept(monkeypatch, tiny_qwen3, tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, "The answer is \\boxed{42}."])
    sample = _generate(monkeypatch, tiny_qwen3, engine, _prompt(tokenizer))
    turns = sample.metadata["turns"]
    assert [t["role"] for t in turns] == ["assistant", "environment", "assistant"]
    assert sample.metadata["stop"] == "done" and sample.status == Sample.Status.COMPLETED
    assert sample.metadata["tool_calls"] == 1
    response = sample.response_tokens
    assert len(response) == sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
    # model turns: exactly the engine's ids (one per character, which re-encoding the text would merge)
    for turn, text in zip([turns[0], turns[2]], [CALL, "The answer is \\boxed{42}."]):
        ids = response[turn["start"]:turn["start"] + turn["length"]]
        assert ids == _char_ids(tokenizer, text) + [tokenizer.eos_token_id]
        assert sample.loss_mask[turn["start"]:turn["start"] + turn["length"]] == [1] * turn["length"]
        assert sample.rollout_log_probs[turn["start"]] == pytest.approx(-0.1)
    assert tokenizer(CALL, add_special_tokens=False)["input_ids"] != _char_ids(tokenizer, CALL)  # the test can fail
    env = turns[1]
    assert sample.loss_mask[env["start"]:env["start"] + env["length"]] == [0] * env["length"]
    assert sample.rollout_log_probs[env["start"]:env["start"] + env["length"]] == [0.0] * env["length"]
    assert tokenizer.decode(response[env["start"]:env["start"] + env["length"]]) == (
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    # the second request continued the exact token sequence, tool turn included
    assert engine.requests[1][0] == sample.tokens[:sample.prompt_length + turns[2]["start"]]
    assert engine.requests[1][1]["max_tokens"] == 400 - turns[2]["start"]
    assert sample.weight_versions == [3]


def test_same_layout_as_the_chat_template_for_canonical_text(tokenizer):
    """For text that tokenizes canonically, the sequence equals a fresh render of the whole conversation."""
    conversation = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"},
                    {"role": "assistant", "content": "The answer is \\boxed{42}."}]
    ids, mask = multi_turn.conversation_to_tokens(tokenizer, conversation)
    messages = [{"role": "user", "content": "q"}, *conversation]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids) + "\n" == full[len(prompt):]  # the template ends each turn with "\n"
    assert sum(mask) == len(ids) - len(multi_turn.environment_turn_ids(tokenizer, conversation[1:2], [2]))


def test_model_turn_ended_by_a_stop_string_is_closed_by_the_environment_turn(tokenizer):
    with_eos = multi_turn.environment_turn_ids(tokenizer, [{"role": "tool", "content": "1"}],
                                               [5, tokenizer.eos_token_id])
    without = multi_turn.environment_turn_ids(tokenizer, [{"role": "tool", "content": "1"}], [5])
    assert without == [tokenizer.eos_token_id] + with_eos


def test_malformed_call_is_reported_to_the_model(monkeypatch, tiny_qwen3, tokenizer):
    engine = ScriptedEngine(tokenizer, ["<tool_call>{oops</tool_call>", "ok"])
    sample = _generate(monkeypatch, tiny_qwen3, engine, _prompt(tokenizer))
    env = sample.metadata["turns"][1]
    text = tokenizer.decode(sample.response_tokens[env["start"]:env["start"] + env["length"]])
    assert "Error: tool call is not valid JSON" in text and sample.status == Sample.Status.COMPLETED


def test_max_turns(monkeypatch, tiny_qwen3, tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL] * 5)
    sample = _generate(monkeypatch, tiny_qwen3, engine, _prompt(tokenizer), max_turns=3)
    assert [t["role"] for t in sample.metadata["turns"]] == ["assistant", "environment"] * 2 + ["assistant"]
    assert sample.metadata["stop"] == "max_turns" and len(engine.requests) == 3


def test_token_budget_covers_every_turn(monkeypatch, tiny_qwen3, tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, CALL, CALL], eos=False)
    sample = _generate(monkeypatch, tiny_qwen3, engine, _prompt(tokenizer), max_tokens=len(CALL) + 20)
    assert sample.response_length <= len(CALL) + 20
    assert sample.status == Sample.Status.TRUNCATED and sample.metadata["stop"] == "max_tokens"


async def _always(args, sample, model_text, turn):
    return [{"role": "user", "content": f"turn {turn} seen"}]


def test_custom_environment(monkeypatch, tiny_qwen3, tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", "b", "c"])
    sample = _generate(monkeypatch, tiny_qwen3, engine, _prompt(tokenizer), environment=_always, max_turns=3)
    assert [t["role"] for t in sample.metadata["turns"]] == ["assistant", "environment"] * 2 + ["assistant"]
    assert "<|im_start|>user\nturn 1 seen<|im_end|>" in sample.response


def test_turn_cap_ends_a_turn_not_the_episode(monkeypatch, tiny_qwen3, tokenizer):
    engine = ScriptedEngine(tokenizer, ["x" * 50, "y" * 50, "z" * 50], eos=False)
    sample = _generate(monkeypatch, tiny_qwen3, engine, _prompt(tokenizer), environment=_always, max_turns=3,
                       max_turn_tokens=8)
    turns = sample.metadata["turns"]
    assert [t["length"] for t in turns if t["role"] == "assistant"] == [8, 8, 8]
    assert sample.metadata["stop"] == "max_turns" and sample.status == Sample.Status.COMPLETED
    # the cut turn is closed by the environment turn's end-of-turn token
    env = turns[1]
    assert sample.response_tokens[env["start"]] == tokenizer.eos_token_id


def test_generate_has_the_hook_signature():
    import inspect

    assert list(inspect.signature(multi_turn.generate).parameters)[:3] == ["args", "sample", "sampling_params"]
    assert list(inspect.signature(multi_turn.sft_generate_rollout).parameters) == [
        "args", "rollout_id", "data_source", "evaluation"]


def test_sft_rollout_lays_out_conversations(tiny_qwen3, tokenizer):
    from vime.data.data_source import RolloutDataSource

    conversation = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"},
                    {"role": "assistant", "content": "The answer is \\boxed{42}."}]
    prompt = _prompt(tokenizer)
    prompt.metadata["conversation"] = conversation
    source = RolloutDataSource([prompt], n_samples_per_prompt=1, seed=0, shuffle=False)
    args = SimpleNamespace(hf_checkpoint=str(tiny_qwen3), rollout_batch_size=1)
    [[sample]] = multi_turn.sft_generate_rollout(args, 0, source)
    ids, mask = multi_turn.conversation_to_tokens(tokenizer, conversation)
    assert sample.response_tokens == ids and sample.loss_mask == mask and 0 in mask and 1 in mask
    bad = _prompt(tokenizer)
    with pytest.raises(ValueError, match="metadata\\['conversation'\\]"):
        multi_turn.sft_generate_rollout(args, 0, RolloutDataSource([bad], n_samples_per_prompt=1, seed=0,
                                                                   shuffle=False))
