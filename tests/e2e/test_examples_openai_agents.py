"""The two agent examples in a reduced configuration on the real stack (1 vLLM engine behind vllm-router,
Megatron-core, Ray): examples/multi_agent (solver + checker, per-agent rewards, train.py) and
examples/async_agent (two-turn agent loop, train_async.py). Both drive the policy through vime's
OpenAI-compatible endpoint with the `openai` client; the saved rollouts must have the trajectory structure
training relies on, and the trainer's log-probs of the recorded tokens must match the recorded ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.processes import stack_pids
from vime.data.sample import Sample
from vime.rollout.debug_data import load_rollout

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
GROUPS, GROUP_SIZE = 2, 2


def _run(entry: str, model: Path, data: Path, out: Path, agent_module: str, num_rollout: int, *extra: str):
    assert not stack_pids(), "engine or router processes are already running"
    cmd = [sys.executable, str(REPO / entry), "--hf-checkpoint", str(model), "--prompt-data", str(data),
           "--label-key", "label", "--rollout-shuffle", "--seed", "1234",
           "--custom-generate-function-path", f"{agent_module}.generate",
           "--custom-rm-path", "vime.agents.harness.agent_reward", "--router-policy", "consistent_hash",
           "--rollout-batch-size", str(GROUPS), "--n-samples-per-prompt", str(GROUP_SIZE),
           "--num-rollout", str(num_rollout), "--rollout-max-response-len", "12", "--micro-batch-size", "4",
           "--advantage-estimator", "grpo", "--lr", "1e-3", "--rollout-num-gpus", "1", "--vllm-enforce-eager",
           "--vllm-dtype", "float32", "--vllm-max-model-len", "256",
           "--save-debug-rollout-data", str(out / "rollouts" / "{rollout_id}.jsonl"), "--output-dir", str(out),
           *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the Ray rollout process imports the example's agent
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert not stack_pids(), "engine or router processes outlived the run"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_trajectory(s: Sample, turns: int) -> None:
    assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED), s.metadata.get("failure")
    assert len(s.tokens) == s.prompt_length + s.response_length
    assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    assert [t["prompt_tokens"] for t in s.metadata["agent_turns"]][0] == s.prompt_length
    assert len(s.metadata["agent_turns"]) == turns
    # the loss mask is 1 on exactly the sampled tokens of each turn, 0 on the context between turns
    expected = []
    for turn in s.metadata["agent_turns"]:
        expected += [0] * (turn["prompt_tokens"] - s.prompt_length - len(expected))
        expected += [1] * turn["completion_tokens"]
    assert s.loss_mask == expected
    assert all(lp <= 0 if m else lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask))
    assert s.weight_versions and s.reward is not None


def test_multi_agent_example(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    from examples.multi_agent.make_data import write_data

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    data = write_data(tmp_path / "data", n_train=32, n_eval=4)
    out = tmp_path / "run"
    records = _run("train.py", tiny_qwen3, data["train"], out, "examples.multi_agent.agent", 2,
                   "--rollout-function-path", "vime.agents.harness.generate_rollout")
    for rollout_id in range(2):
        samples = [s for g in load_rollout(str(out / "rollouts" / "{rollout_id}.jsonl"), rollout_id) for s in g]
        # one GRPO group (n-samples-per-prompt consecutive samples, as the trainer groups them) per role and
        # prompt, the same episodes in the same order
        groups = [samples[i:i + GROUP_SIZE] for i in range(0, len(samples), GROUP_SIZE)]
        assert [[s.metadata["agent_role"] for s in g] for g in groups] == [["solver"] * GROUP_SIZE,
                                                                             ["checker"] * GROUP_SIZE] * GROUPS
        for solver_group, checker_group in zip(groups[::2], groups[1::2]):
            assert [s.index for s in solver_group] == [s.index for s in checker_group]
            for solver, checker in zip(solver_group, checker_group):
                _check_trajectory(solver, turns=1)
                _check_trajectory(checker, turns=1)
                assert solver.metadata["agent_session"].endswith("/solver")
                assert checker.metadata["agent_session"].endswith("/checker")
                assert solver.metadata["agent_session"].split("/")[0] == checker.metadata["agent_session"].split("/")[0]
                # per-agent rewards: each role scored on its own answer
                assert solver.reward == solver.metadata["agent_reward"] and solver.reward in (0.0, 1.0)
                assert checker.reward == checker.metadata["agent_reward"] and checker.reward in (0.0, 1.0)
                # the checker saw the solver's answer (its sampled tokens as text) in its prompt
                assert tokenizer.decode(solver.response_tokens, skip_special_tokens=True) in \
                    checker.prompt[0]["content"]
    train = [r for r in records if "train/steps" in r]
    assert [r["train/steps"] for r in train] == [2.0, 2.0]  # 2 roles: twice the samples of a rollout
    for r in train:  # the trainer's log-probs of the recorded tokens are the engine's
        assert r["train_rollout_logprob_abs_diff"] < 1e-4, r


def test_async_agent_example(tiny_qwen3, tmp_path):
    from examples.async_agent.make_data import write_data

    data = write_data(tmp_path / "data", n_train=32, n_eval=4)
    out = tmp_path / "run"
    records = _run("train_async.py", tiny_qwen3, data["train"], out, "examples.async_agent.agent", 3)
    for rollout_id in range(3):
        groups = load_rollout(str(out / "rollouts" / "{rollout_id}.jsonl"), rollout_id)
        assert [len(g) for g in groups] == [GROUP_SIZE] * GROUPS
        for s in (s for g in groups for s in g):
            _check_trajectory(s, turns=2)
            first, second = s.metadata["agent_turns"]
            assert second["prompt_tokens"] > s.prompt_length + first["completion_tokens"]  # the follow-up is context
            assert s.metadata["agent_role"] == "main" and s.reward in (0.0, 1.0)
            assert s.weight_versions == [rollout_id - 1 if rollout_id > 0 else 0]  # one update stale
    train = [r for r in records if "train/steps" in r]
    assert [r["async/staleness_max"] for r in train] == [0.0, 1.0, 1.0]
    assert train[0]["train_rollout_logprob_abs_diff"] < 1e-4, train[0]  # rollout 0 is on-policy
