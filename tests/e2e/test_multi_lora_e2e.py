"""Multi-LoRA on the real stack (tiny model, 2 vLLM engines behind vllm-router, Megatron-core, Ray): two adapters
on one frozen base, trained in the same steps, each on its own prompts with its own reward, and served by the
same engines under their own names. The rewards pull in opposite directions (the share of response tokens on one
side of the output layer, or on the other: `multi_lora_rewards.py`), so one set of weights could not raise both.

Checked in one run: each adapter learns its own task (its held-out eval set, evaluated with it, rises by 0.1 or
more; its training reward rises); every rollout takes an equal share of prompts per adapter, each sample is scored
by its adapter's reward, and the per-adapter metrics are those of the saved samples; no request was served by the
other adapter (the trainer, computing each sample through the sample's own adapter, finds the engines' log-probs
of every token within 1e-5, while the two adapters' policies move apart: a token served by the wrong one would be
off by far more); after every update each engine serves each adapter with the trainer's weights
(--check-weight-update-equal, per adapter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.crash_hold_plugin import held_run_env
from tests.e2e.multi_lora_rewards import high_share
from tests.e2e.processes import stack_pids
from vime.data.sample import ADAPTER_KEY
from vime.rollout.debug_data import load_rollout

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 8
ADAPTERS = ("high", "low")


def _split(rows: list[str], out: Path) -> dict[str, Path]:
    """Disjoint prompt files, one per adapter."""
    files = {}
    for k, name in enumerate(ADAPTERS):
        files[name] = out / f"{out.name}_{name}.jsonl"
        files[name].write_text("".join(f"{row}\n" for row in rows[k::len(ADAPTERS)]))
    return files


def _reward(name: str, sample, checkpoint: Path) -> float:
    share = high_share(sample.tokens[len(sample.tokens) - sample.response_length:], str(checkpoint))
    return share if name == "high" else 1.0 - share


def test_two_adapters_learn_opposite_tasks_on_one_base(tiny_qwen3, arithmetic_data, tmp_path):
    assert not stack_pids()
    (tmp_path / "train").mkdir()
    (tmp_path / "eval").mkdir()
    train = _split(arithmetic_data[0].read_text().splitlines(), tmp_path / "train")
    held_out = _split(arithmetic_data[1].read_text().splitlines(), tmp_path / "eval")
    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3),
           "--lora-rank", "8", "--lora-alpha", "16", "--lora-adapters",
           *(f"{name}={train[name]}:multi_lora_rewards.{name}" for name in ADAPTERS),
           "--eval-prompt-data", *(x for name in ADAPTERS for x in (name, str(held_out[name]))),
           "--eval-interval", str(NUM_ROLLOUT), "--n-samples-per-eval-prompt", "4",
           "--apply-chat-template", "--rollout-shuffle", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
           "--num-rollout", str(NUM_ROLLOUT), "--rollout-num-gpus", "1", "--rollout-max-response-len", "16",
           "--micro-batch-size", "16", "--lr", "1e-2", "--check-weight-update-equal",
           "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.jsonl"),
           "--output-dir", str(tmp_path / "run"), "--vllm-enforce-eager", "--vllm-max-model-len", "256"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=held_run_env())
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert not stack_pids(), f"processes left after the run: {stack_pids()}"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    rewards = {name: [] for name in ADAPTERS}
    for rollout_id in range(NUM_ROLLOUT):
        samples = [s for g in load_rollout(str(tmp_path / "rollout_{rollout_id}.jsonl"), rollout_id) for s in g]
        by_adapter = {name: [s for s in samples if s.metadata[ADAPTER_KEY] == name] for name in ADAPTERS}
        assert [len(by_adapter[name]) for name in ADAPTERS] == [32, 32]  # an equal share of prompts each
        metrics = next(r for r in records if r.get("rollout_id") == rollout_id and "rollout/reward_mean" in r)
        for name, group in by_adapter.items():
            assert all(s.reward == pytest.approx(_reward(name, s, tiny_qwen3)) for s in group)  # its own reward
            mean = sum(s.reward for s in group) / len(group)
            assert metrics[f"rollout/adapter/{name}/reward_mean"] == pytest.approx(mean, abs=1e-6)
            rewards[name].append(mean)
    evals = {name: [r[f"eval/{name}/reward_mean"] for r in records if f"eval/{name}/reward_mean" in r]
             for name in ADAPTERS}
    print("rollout rewards:", {name: [round(r, 3) for r in values] for name, values in rewards.items()},
          "eval:", evals)
    for name in ADAPTERS:
        before, after = evals[name]
        assert after >= before + 0.1, (name, evals)
        assert sum(rewards[name][-2:]) > sum(rewards[name][:2]), (name, rewards)

    trained = [r for r in records if "train/steps" in r]
    assert [r["rollout_id"] for r in trained] == list(range(NUM_ROLLOUT))
    for r in trained:
        assert r["weight_check/max_abs_logprob_diff"] < 1e-5, r
        assert r["train_rollout_logprob_abs_diff"] < 1e-5, r
        assert r["train_rollout_logprob_abs_diff_max"] < 1e-5, r
