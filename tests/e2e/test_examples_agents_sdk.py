"""examples/agents_sdk in a reduced configuration on the real stack (1 vLLM engine behind vllm-router,
Megatron-core, Ray): an OpenAI Agents SDK agent (`agents.Agent` + a `@function_tool`, `Runner.run`) drives the
policy through the endpoint's Responses API route and is trained with GRPO.

The random-init `tiny_qwen3` has never seen the call format, so the run uses the example's agent with
tool_choice="required" (`generate_tool_required`): the engine's structured output holds the first reply to a
JSON call of `get_price`, the SDK runs the tool and asks again (the SDK resets tool_choice after a tool ran), and the
policy answers after the tool's output. Every trained sample must hold both model turns, the tool's output as
context between them, and the loss mask on exactly the sampled tokens."""

from __future__ import annotations

import json
import math

import pytest

from tests.e2e.test_examples_openai_agents import GROUP_SIZE, GROUPS, _check_trajectory, _run
from tests.helpers.advantage_reference import check_grpo_stats, on_policy_grpo_pg_loss
from vime.rollout.debug_data import load_rollout

pytestmark = pytest.mark.e2e


def test_agents_sdk_example(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    from examples.agents_sdk.agent import ITEMS, last_number
    from examples.agents_sdk.make_data import first_messages, sdk_tools, write_data

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    data = write_data(tmp_path / "data", n_train=16, n_eval=2, n_sft=2)
    out = tmp_path / "run"
    # later flags win: the SDK's first request is ~330 tokens; 64 fit a forced call even spelled letter by letter.
    # xgrammar reads disable_any_whitespace from the engine's config only (not per request): without it a
    # random-init model can pad the forced JSON call with whitespace until the length limit (seen in CI)
    records = _run("train.py", tiny_qwen3, data["train"], out, "examples.agents_sdk.agent", 1,
                   "--custom-generate-function-path", "examples.agents_sdk.agent.generate_tool_required",
                   "--rollout-max-response-len", "64", "--vllm-max-model-len", "640",
                   "--vllm-structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')
    groups = load_rollout(str(out / "rollouts" / "{rollout_id}.jsonl"), 0)
    assert [len(g) for g in groups] == [GROUP_SIZE] * GROUPS
    for s in (s for g in groups for s in g):
        turns = s.metadata["agent_turns"]
        assert len(turns) >= 2, turns  # the tool call, then the answer after the tool's output
        _check_trajectory(s, turns=len(turns))
        assert any(lp < 0 for lp in s.rollout_log_probs), "no rollout log-probs recorded"
        assert s.metadata["agent_role"] == "main" and s.reward in (0.0, 1.0)
        # the first request, as the endpoint rendered it: the agent's instructions as the system message, the
        # question, the tool block (what make_data's SFT rows render; "required" adds its line)
        question = s.prompt[-1]["content"]
        assert s.prompt == first_messages(question)
        expected = tokenizer.apply_chat_template(first_messages(question), tools=sdk_tools(), tokenize=False,
                                                 add_generation_prompt=True, tool_choice="required")
        assert s.tokens[:s.prompt_length] == tokenizer(expected, add_special_tokens=False)["input_ids"]
        # turn 1: the sampled tokens are a JSON call of get_price; the SDK ran it and sent its output back
        first_end = s.prompt_length + turns[0]["completion_tokens"]
        call = json.loads(tokenizer.decode(s.tokens[s.prompt_length:first_end], skip_special_tokens=True))
        assert call["name"] == "get_price" and call["arguments"]["item"] in ITEMS, call
        between = tokenizer.decode(s.tokens[first_end:turns[1]["prompt_tokens"]], skip_special_tokens=False)
        assert f"<|im_start|>tool\n{s.metadata['prices'][call['arguments']['item']]}<|im_end|>" in between
        assert between.endswith("<|im_start|>assistant\n")
        # the reward: 1 exactly when the call asked for the asked item and the answer's last number is its price;
        # an answer cut off at the length limit fails the SDK's episode (`agent.run`: reward 0) whatever it says
        answer = tokenizer.decode(s.tokens[turns[-1]["prompt_tokens"]:][:turns[-1]["completion_tokens"]],
                                  skip_special_tokens=True)
        finished = turns[-1]["finish_reason"] != "length"
        right = finished and call["arguments"]["item"] == s.metadata["item"] and last_number(answer) == s.label
        assert s.reward == float(right), (call, answer, s.label)
    train = [r for r in records if "train/steps" in r]
    assert len(train) == 1
    for r in train:  # the trajectories' math, from the saved rollout: GRPO's advantages, the on-policy loss
        assert all(math.isfinite(r[k]) for k in ("train/loss", "train/pg_loss", "train/grad_norm")), r
        check_grpo_stats(r, groups)
        assert r["train/pg_loss"] == pytest.approx(on_policy_grpo_pg_loss(groups), abs=1e-5), r
        assert r["train/pg_clipfrac"] == 0.0, r  # on policy: no ratio leaves the clip range
        # no train/rollout log-prob equality here: the forced first call is sampled under a grammar, and the engine
        # reports the log-probs of that constrained distribution (a forced token near 0), the trainer the model's
