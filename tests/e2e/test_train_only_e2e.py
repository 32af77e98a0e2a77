"""PPO through `train.py` on the real stack without engines (--debug-train-only on saved rollouts): two actor
ranks and two critic ranks (data parallel), rollouts through the straw transport, read by each rank itself.

At the first rollout the critic's values are 0 (zero-initialised head) and there is no KL, so with gamma =
lambda = 1 every response token's return and advantage is the sample's reward: the token-mean policy loss is
minus the token-weighted mean reward, and the value loss is half of it. Both are computed here from the saved
rollout and must match what the ranks report. Rollout 2 repeats rollout 0's samples: the critic, trained twice
since, must fit their returns better (a lower value loss), and the advantages stay GAE's (returns = A + V)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.rollouts import make_rollout

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_ppo_with_a_critic_trains_from_the_transport(tiny_qwen3, tmp_path):
    from vime.rollout.debug_data import save_rollout
    from vime.data.sample import Sample

    template = str(tmp_path / "rollout_{rollout_id}.jsonl")
    rollouts = [make_rollout(seed=seed) for seed in (0, 1, 0)]
    for r, groups in enumerate(rollouts):
        save_rollout(template, r, [[Sample.from_dict(d) for d in g] for g in groups])
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3), "--debug-train-only",
           "--load-debug-rollout-data", template, "--rm-type", "math", "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "4", "--num-rollout", "3", "--micro-batch-size", "4", "--lr", "1e-3",
           "--critic-lr", "3e-3",
           "--advantage-estimator", "ppo", "--actor-num-gpus-per-node", "2", "--rollout-data-transport", "straw",
           "--output-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    samples = [s for g in rollouts[0] for s in g]
    reward_per_token = (sum(s["reward"] * s["response_length"] for s in samples)
                        / sum(s["response_length"] for s in samples))
    first, second, again = records
    assert first["train/pg_loss"] == pytest.approx(-reward_per_token, abs=1e-5)
    assert first["critic/value_loss"] == pytest.approx(0.5 * reward_per_token, abs=1e-5)
    assert first["critic/values_mean"] == 0.0
    # values 0: every token's advantage and return is its sample's reward
    assert first["train/advantage_mean"] == pytest.approx(reward_per_token, abs=1e-5)
    assert first["train/return_mean"] == pytest.approx(reward_per_token, abs=1e-5)
    assert second["critic/values_mean"] != 0.0  # the critic's step moved its values
    assert again["critic/value_loss"] < 0.8 * first["critic/value_loss"], (first, again)  # same samples, fit better
    # returns = advantages + values, so their means differ by the values' token mean
    assert again["train/return_mean"] - again["train/advantage_mean"] == pytest.approx(again["critic/values_mean"],
                                                                                       abs=1e-4)
    assert all(r["critic/grad_norm"] > 0 and r["train/grad_norm"] > 0 for r in records)
    assert all(r["train/num_usable_samples"] == 16 for r in records)

    trained = [json.loads(line) for line in (out / "trained_samples.jsonl").read_text().splitlines()]
    assert [t["sample_ids"] for t in trained] == [[s["index"] for g in groups for s in g] for groups in rollouts]
    # without --save nothing will replay them: the run let the stored rollouts go
    assert list((out / "rollout_data" / "index").glob("rollout_*.json")) == []


def test_a_rollout_function_that_never_returns_stops_the_run(tiny_qwen3, arithmetic_data, tmp_path):
    """--rollout-timeout: the run fails with a message naming the rollout function, and leaves no process."""
    from tests.e2e.crash_hold_plugin import held_run_env
    from tests.e2e.processes import stack_pids

    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3), "--debug-train-only",
           "--rollout-function-path", "crash_hold_plugin.never_returns", "--rollout-timeout", "5",
           "--prompt-data", str(arithmetic_data[0]), "--label-key", "label", "--rm-type", "math",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "2",
           "--micro-batch-size", "4", "--output-dir", str(tmp_path / "run")]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=held_run_env())
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert "--rollout-timeout 5s" in proc.stderr and "crash_hold_plugin.never_returns" in proc.stderr, \
        proc.stderr[-3000:]
    assert took < 120, f"the run took {took:.0f}s to give up on a 5 s rollout timeout"
    assert not stack_pids()
