"""`--environment` on the real stack (tiny model, 2 vLLM engines behind vllm-router, Megatron-core, Ray), one run
of two rollouts with the train/rollout gap check: a weighted mixture of two reasoning-gym datasets (single turn,
scored by reasoning-gym) and an OpenEnv environment served by a local server process vime starts and stops (multi
turn, stepped over its WebSocket session). Every reported reward is recomputed from the saved samples (reasoning-
gym's own scorer; the OpenEnv environment's rule), the saved tokens and loss masks are checked against the chat
template piece by piece, and each environment has its own eval set. Also a judge served by the run, and the
reasoning-gym example learning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.processes import stack_pids

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
RG_ARGS = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
           "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                "operators": ["+", "*"], "allow_parentheses": False}}


def _run(cmd, timeout=900):
    assert not stack_pids(), "engine or router processes are already running"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    deadline = time.monotonic() + 10  # an engine core may still be exiting when the driver returns
    while stack_pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not stack_pids(), f"the run left engine or router processes behind: {stack_pids()}"


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def _samples(out: Path, name: str, rollout_id: int):
    from vime.rollout.debug_data import load_rollout

    return [s for g in load_rollout(str(out / f"rollout_{name}{{rollout_id}}.jsonl"), rollout_id) for s in g]


def check_episode(s, tokenizer):
    """An OpenEnv episode as saved: the prompt from the environment's reset, model turns trained with the engine's
    log-probs, each environment turn the chat template's piece for the step's observation (masked, log-prob 0),
    the rewards the environment's rule gives each model turn, the episode's return as the reward."""
    from tests.environments.openenv_digits import reward
    from vime.agents.multi_turn import environment_turn_ids

    digit = str(s.metadata["openenv"]["seed"] % 10)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Say the digit {digit}."}],
                                           add_generation_prompt=True, tokenize=False)
    assert s.tokens[:s.prompt_length] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response, texts, previous = s.response_tokens, [], []
    for turn in s.metadata["turns"]:
        piece = slice(turn["start"], turn["start"] + turn["length"])
        if turn["role"] == "assistant":
            previous = response[piece]
            texts.append(tokenizer.decode(previous, skip_special_tokens=True))
            assert s.loss_mask[piece] == [1] * turn["length"]
        else:
            assert response[piece] == environment_turn_ids(
                tokenizer, [{"role": "user", "content": f"No. Say the digit {digit}."}], previous)
            assert s.loss_mask[piece] == [0] * turn["length"] and s.rollout_log_probs[piece] == [0.0] * turn["length"]
    assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs)
    stepped = texts if s.metadata["stop"] in ("done", "max_turns") else texts[:-1]  # a cut turn is no action
    episode = s.metadata["openenv"]
    assert episode["rewards"] == [reward(int(digit), t) for t in stepped] and episode["steps"] == len(stepped)
    assert episode["done"] == (1.0 in episode["rewards"] or len(stepped) == 2)
    assert s.reward == sum(episode["rewards"])


def test_reasoning_gym_and_openenv_mixture(tiny_qwen3, tmp_path):
    import reasoning_gym
    from reasoning_gym.utils import extract_answer
    from transformers import AutoTokenizer

    _run([sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3),
          "--environment", "reasoning_gym:chain_sum,basic_arithmetic", "--environment-args", json.dumps(RG_ARGS),
          "--environment", "openenv:tests.environments.openenv_digits", "--environment-args", '{"size": 40}',
          "--environment-weights", "2", "2", "--agent-max-turns", "2", "--agent-max-turn-tokens", "6",
          "--reasoning-gym-weights", "3", "1", "--reasoning-gym-size", "40", "--reasoning-gym-seed", "5",
          "--reasoning-gym-system-prompt", "none", "--environment-eval-size", "4", "--eval-interval", "100",
          "--apply-chat-template", "--rollout-shuffle", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
          "--num-rollout", "2", "--rollout-num-gpus", "1", "--rollout-max-response-len", "40",
          "--micro-batch-size", "8", "--lr", "1e-2", "--check-weight-update-equal",
          "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.jsonl"),
          "--output-dir", str(tmp_path / "run"), "--vllm-enforce-eager", "--vllm-max-model-len", "256"])
    records = _metrics(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    datasets = {name: reasoning_gym.create_dataset(name, size=44, seed=5, **cfg) for name, cfg in RG_ARGS.items()}

    def check_sample(s, name, indices):
        entry = datasets[name][s.metadata["reasoning_gym"]["index"]]
        assert s.metadata["reasoning_gym"]["index"] in indices
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": entry["question"]}],
                                               add_generation_prompt=True, tokenize=False)
        assert s.tokens[:s.prompt_length] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert s.label == entry["answer"]
        expected = datasets[name].score_answer(extract_answer(s.response), entry)
        assert s.reward == pytest.approx(expected) and s.metadata["reward_functions"] == {"score_answer": expected}
        assert s.loss_mask == [1] * s.response_length and len(s.rollout_log_probs) == s.response_length

    train = [r for r in records if "train/steps" in r]
    assert [r["rollout_id"] for r in train] == [0, 1]
    drawn = []
    for r in train:
        assert r["weight_check/max_abs_logprob_diff"] < 1e-5 and r["train_rollout_logprob_abs_diff"] < 1e-5, r
        samples = _samples(tmp_path, "", r["rollout_id"])
        assert len(samples) == 16
        for name in RG_ARGS:
            mine = [s for s in samples if s.metadata["environment"] == name]
            for s in mine:
                check_sample(s, name, range(40))
            drawn += [name] * (len(mine) // 4)
            if mine:
                mean = sum(s.reward for s in mine) / len(mine)
                assert r[f"rollout/env/{name}/reward_mean"] == pytest.approx(mean, abs=1e-9), r
                assert r[f"rollout/env/{name}/fn/score_answer_mean"] == pytest.approx(mean, abs=1e-9), r
                assert r[f"rollout/env/{name}/fn/score_answer_weight"] == 1.0
                assert r[f"rollout/env/{name}/num_samples"] == len(mine)
        digits = [s for s in samples if s.metadata["environment"] == "openenv_digits"]
        for s in digits:
            check_episode(s, tokenizer)
        drawn += ["openenv_digits"] * (len(digits) // 4)
        if digits:
            mean = sum(s.reward for s in digits) / len(digits)
            assert r["rollout/env/openenv_digits/reward_mean"] == pytest.approx(mean, abs=1e-9), r
            assert r["rollout/env/openenv_digits/fn/episode_return_mean"] == pytest.approx(mean, abs=1e-9), r
            terminated = sum(s.metadata["openenv"]["done"] for s in digits) / len(digits)
            assert r["rollout/env/openenv_digits/fn/terminated_mean"] == pytest.approx(terminated), r
            assert r["rollout/env/openenv_digits/fn/terminated_weight"] == 0.0
    # weights 2 (chain_sum 3 : basic_arithmetic 1 within it) : 2 over 8 groups
    assert (drawn.count("chain_sum"), drawn.count("basic_arithmetic"), drawn.count("openenv_digits")) == (3, 1, 4)
    assert any(r["train/grad_norm"] > 0 for r in train)

    evals = [r for r in records if "eval/chain_sum/reward_mean" in r]
    for r in evals:
        samples = _samples(tmp_path, "eval_openenv_digits_", r["rollout_id"])
        assert sorted(s.metadata["openenv"]["seed"] for s in samples) == [40, 41, 42, 43]
        for s in samples:
            check_episode(s, tokenizer)
        assert r["eval/openenv_digits/reward_mean"] == pytest.approx(sum(s.reward for s in samples) / 4, abs=1e-9)
    assert [r["rollout_id"] for r in evals] == [0, 2]
    for r in evals:
        for name in RG_ARGS:
            samples = _samples(tmp_path, f"eval_{name}_", r["rollout_id"])
            assert len(samples) == 4
            for s in samples:
                check_sample(s, name, range(40, 44))  # the entries after the training ones
            mean = sum(s.reward for s in samples) / 4
            assert r[f"eval/{name}/reward_mean"] == pytest.approx(mean, abs=1e-9), r
            assert r[f"eval/{name}/fn/score_answer_mean"] == pytest.approx(mean, abs=1e-9), r


def test_judge_served_by_the_run(tiny_qwen3, arithmetic_data, tmp_path):
    """A tiny judge model (another seed than the policy) on its own engine grades the policy's answers through the
    reward function above. After the policy's weights moved (two rollouts, each followed by an update the engines
    took, checked exactly), the judge's replies still carry the log-probs of its own checkpoint, recomputed by a
    transformers forward: nothing updated it. Its calls are counted in the metrics."""
    from tests.helpers.hf_reference import load_hf, response_log_probs
    from vime.synthetic.tiny_model import build_tiny_model

    judge = build_tiny_model(tmp_path / "judge", arch="qwen3", seed=7)
    _run([sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3),
          "--prompt-data", str(arithmetic_data[0]), "--label-key", "label", "--apply-chat-template",
          "--custom-rm-path", "tests.e2e.judge_reward.reward", "--judge-checkpoint", str(judge),
          "--judge-timeout", "60", "--judge-concurrency", "8", "--judge-temperature", "1.0",
          "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "2",
          "--rollout-num-gpus", "1", "--rollout-max-response-len", "12", "--micro-batch-size", "8", "--lr", "1e-2",
          "--check-weight-update-equal", "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.jsonl"),
          "--output-dir", str(tmp_path / "run"), "--vllm-enforce-eager", "--vllm-max-model-len", "256",
          "--vllm-dtype", "float32"])
    train = [r for r in _metrics(tmp_path) if "train/steps" in r]
    assert [r["rollout_id"] for r in train] == [0, 1]
    for r in train:
        assert r["weight_check/max_abs_logprob_diff"] < 1e-5, r
    assert any(r["train/grad_norm"] > 0 for r in train), "the policy's weights did not move"
    assert [r["judge/calls"] for r in train] == [16.0, 32.0]  # one call per sample, running total
    assert all(r.get("judge/errors", 0.0) == 0 and r.get("judge/timeouts", 0.0) == 0 for r in train)
    assert train[-1]["judge/completion_tokens"] > 0 and train[-1]["judge/time_s"] > 0

    model = load_hf(judge)
    for rollout_id in (0, 1):
        samples = _samples(tmp_path, "", rollout_id)
        assert len(samples) == 16
        for s in samples[:4]:
            reply = s.metadata["judge"]
            assert s.reward == float(reply["token_ids"][0] % 2)
            tokens = reply["prompt_token_ids"] + reply["token_ids"]
            expected = response_log_probs(model, tokens, len(reply["prompt_token_ids"]))
            assert max(abs(a - b) for a, b in zip(reply["logprobs"], expected.tolist())) < 1e-4


@pytest.mark.skipif(not os.environ.get("VIME_TEST_LEARNING_EXAMPLES"),
                    reason="131 s: VIME_TEST_LEARNING_EXAMPLES=1 runs it (the quickstart's learning test runs in CI)")
def test_reasoning_gym_example_learns(tmp_path):
    """examples/reasoning_gym/run.sh as a user runs it, GRPO cut from 60 rollouts to 45 with one eval at each end:
    the model learns reasoning-gym's task, its held-out eval reward rising by 0.2 or more (0.242 -> 0.602 measured),
    and the reward curve is drawn."""
    env = {**os.environ, "SKIP_INSTALL": "1", "OUT": str(tmp_path), "VIME_PROGRESS": "0", "PY": sys.executable,
           "NUM_ROLLOUT": "45", "EVAL_INTERVAL": "45"}
    assert not stack_pids()
    proc = subprocess.run(["bash", str(REPO / "examples" / "reasoning_gym" / "run.sh")], capture_output=True,
                          text=True, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["rollout_id"]: r["eval/basic_arithmetic/reward_mean"] for r in records
             if "eval/basic_arithmetic/reward_mean" in r}
    print(f"reasoning-gym example eval reward: {evals}")
    assert sorted(evals) == [0, 45] and evals[45] >= evals[0] + 0.2, evals
    assert (tmp_path / "grpo" / "reward_curve.png").stat().st_size > 0
