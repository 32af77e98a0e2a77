"""`--environment verifiers:...` on the real stack (tiny model, one vLLM engine behind vllm-router, Megatron-core,
Ray): one run of two rollouts with the train/rollout gap check over a mixture of two verifiers 0.4 environments
written as verifiers' docs write them, each run by its own bridge process in the verifiers venv: a single-turn
one (tests/environments/vf_arithmetic.py) and a tool-using one whose tool verifiers serves over MCP
(tests/environments/vf_lookup.py: verifiers' tool server lists its tool to the harness, which offers it to the
model; at most two turns). Every reported reward function is recomputed from the saved samples, and the saved
tokens and loss masks are checked against the chat template piece by piece: the prompt (with the tools the harness
offered), the sampled turns (trained), a tool's answer between them (masked).

The untrained model does not call the tool by itself, and forcing a call (tool_choice "required") makes the engine
sample under a grammar whose masked log-probs are not the policy's (a train/rollout gap of ~2.6 measured), which
the gap check would refuse: the tool's round trip (a forced call, verifiers' MCP server answering, the answer as a
masked tool turn) is checked with a scripted engine in tests/environments/test_verifiers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.processes import stack_pids
from vime.environments.verifiers_process import DEFAULT_PYTHON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not os.access(DEFAULT_PYTHON, os.X_OK),
                                                  reason="no .venv-verifiers (bash scripts/install.sh makes it)")]
REPO = Path(__file__).resolve().parents[2]
LOOKUP_ARGS = {"agent": {"max_turns": 2}}
FACTS = {"ada": "first programmer", "grace": "compiler pioneer", "alan": "computability", "edsger": "shortest paths",
         "barbara": "abstract data types", "donald": "art of programming", "john": "lisp", "ken": "unix"}


def _samples(out: Path, rollout_id: int):
    from vime.rollout.debug_data import load_rollout

    return [s for g in load_rollout(str(out / "rollout_{rollout_id}.jsonl"), rollout_id) for s in g]


def _ids(tokenizer, messages, tools=None):
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _reply(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()  # what verifiers' trace.last_reply holds


def check_arithmetic(s, tokenizer) -> dict[str, float]:
    """One model turn after the template's prompt; verifiers' rewards recomputed from its text."""
    i = int(s.metadata["verifiers"]["task"])
    assert s.tokens[:s.prompt_length] == _ids(tokenizer, [{"role": "user", "content": f"What is {i} + {i}?"}])
    assert s.label == str(2 * i) and len(s.metadata["agent_turns"]) == 1
    assert s.loss_mask == [1] * s.response_length and len(s.rollout_log_probs) == s.response_length
    text = _reply(tokenizer, s.response_tokens)
    return {"exact_match": float(text == str(2 * i)), "has_digit": float(any(c.isdigit() for c in text)),
            "brevity": 1.0 / (1.0 + len(text)), "reply_chars": float(len(text))}


def check_lookup(s, tokenizer) -> dict[str, float]:
    """The prompt as the template renders the task with the tool the harness offered; each model turn trained; after a tool call, the tool's answer as the template's
    tool turn, masked with log-prob 0."""
    from vime.agents.multi_turn import environment_turn_ids

    i = int(s.metadata["verifiers"]["task"])
    name = list(FACTS)[i]
    user = {"role": "user", "content": f'Use the `facts_lookup` tool to look up "{name}", then reply with what '
                                       "it returns."}
    # the tool as verifiers' MCP server lists it (the tiny model's template renders a tool's name and parameters)
    tools = [{"type": "function", "function": {"name": "facts_lookup", "parameters": {"properties": {"name": {}}}}}]
    assert s.tokens[:s.prompt_length] == _ids(tokenizer, [user], tools)
    turns, response, used = s.metadata["agent_turns"], s.response_tokens, 0.0
    assert 1 <= len(turns) <= 2 and len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    first = turns[0]["completion_tokens"]
    assert s.loss_mask[:first] == [1] * first
    if len(turns) == 2:  # the first turn was a call (the model wrote one): the tool answered it
        between = turns[1]["prompt_tokens"] - s.prompt_length
        answer = tokenizer.decode(response[first:between]).split("tool\n", 1)[-1].split("<|im_end|>")[0]
        assert response[first:between] == environment_turn_ids(tokenizer, [{"role": "tool", "content": answer}],
                                                                response[:first])
        assert s.loss_mask[first:between] == [0] * (between - first)
        assert s.rollout_log_probs[first:between] == [0.0] * (between - first)
        assert s.loss_mask[between:] == [1] * (s.response_length - between)
        used = 1.0
    last = response[turns[-1]["prompt_tokens"] - s.prompt_length:]
    text = _reply(tokenizer, last)
    return {"used_tool": used, "answered": float(FACTS[name] in text.lower())}


def test_verifiers_single_turn_and_tool_environments_mixture(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    assert not stack_pids(), "engine or router processes are already running"
    started = time.monotonic()
    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3),
           "--environment", "verifiers:tests.environments.vf_arithmetic", "--environment-args", '{"size": 16}',
           "--environment", "verifiers:tests.environments.vf_lookup", "--environment-args", json.dumps(LOOKUP_ARGS),
           "--environment-weights", "1", "1", "--router-policy", "consistent_hash",
           "--apply-chat-template", "--rollout-shuffle", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
           "--num-rollout", "2", "--rollout-num-gpus", "1", "--rollout-max-response-len", "24",
           "--micro-batch-size", "4", "--lr", "1e-2", "--check-weight-update-equal",
           "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.jsonl"),
           "--output-dir", str(tmp_path / "run"), "--vllm-enforce-eager", "--vllm-max-model-len", "512"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the bridges import the environments from the repository
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    deadline = time.monotonic() + 10  # an engine core may still be exiting when the driver returns
    while stack_pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not stack_pids(), f"the run left engine or router processes behind: {stack_pids()}"
    print(f"verifiers e2e run: {time.monotonic() - started:.1f}s")
    bridges = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    assert "verifiers_bridge.py" not in bridges and "vf_lookup" not in bridges, "a bridge or tool server outlived the run"

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/steps" in r]
    assert [r["rollout_id"] for r in train] == [0, 1]
    checks = {"vf_arithmetic": check_arithmetic, "vf_lookup": check_lookup}
    weights = {"vf_arithmetic": {"exact_match": 1.0, "has_digit": 0.5, "brevity": 0.1, "reply_chars": 0.0},
               "vf_lookup": {"used_tool": 0.5, "answered": 1.0}}
    drawn = []
    for r in train:
        assert r["weight_check/max_abs_logprob_diff"] < 1e-5 and r["train_rollout_logprob_abs_diff"] < 1e-5, r
        samples = _samples(tmp_path, r["rollout_id"])
        assert len(samples) == 4
        for name, check in checks.items():
            mine = [s for s in samples if s.metadata["environment"] == name]
            drawn += [name] * (len(mine) // 2)
            for s in mine:
                assert s.status.value in ("completed", "truncated"), s.metadata.get("failure")
                values = check(s, tokenizer)
                assert s.metadata["reward_functions"] == values, (name, s.metadata["reward_functions"], values)
                assert s.metadata["reward_weights"] == weights[name]
                assert s.reward == pytest.approx(sum(values[f] * w for f, w in weights[name].items()))
            if mine:
                assert r[f"rollout/env/{name}/reward_mean"] == pytest.approx(
                    sum(s.reward for s in mine) / len(mine), abs=1e-9), r
                for fn, weight in weights[name].items():
                    mean = sum(s.metadata["reward_functions"][fn] for s in mine) / len(mine)
                    assert r[f"rollout/env/{name}/fn/{fn}_mean"] == pytest.approx(mean, abs=1e-9), r
                    assert r[f"rollout/env/{name}/fn/{fn}_weight"] == weight
    assert drawn == ["vf_arithmetic", "vf_lookup"] * 2  # weights 1 : 1, one group each per rollout
    # a rollout trains exactly when one of its groups' rewards differ (GRPO's advantages; brevity usually parts
    # the two replies, but two replies cut at the same length can tie: seen once in a full suite)
    for r in train:
        samples = _samples(tmp_path, r["rollout_id"])
        parted = any(len({s.reward for s in samples if s.metadata["environment"] == name}) > 1 for name in checks)
        assert (r["train/grad_norm"] > 0) == parted, r
    assert any(r["train/grad_norm"] > 0 for r in train), train
