"""Speculative rollout with the policy's own MTP layer on the real stack (issue 53): a tiny GLM-4.5 with one MTP
layer, engines started with `--vllm-speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'` (vLLM
drafts with the layer), 12 GRPO rollouts on a reward that makes the policy nearly deterministic
(`mtp_rewards.toward_one_side`), twice:

- with --enable-mtp-training (weights sent by broadcast): every update reaches the drafter, which follows the
  policy: the share of drafts accepted (`rollout/spec_acceptance_rate`, from the engines' counters) rises from ~0
  (a random layer's greedy draft: ~1/512) to most of them, and the MTP loss falls;
- with the MTP layer frozen (the trainer holds it, never changes it): the policy moves the same way, and the
  drafts are still rejected.

In both, speculation leaves what is trained the policy's: the rollout log-probs equal the trainer's
(`train_rollout_logprob_abs_diff_max` <= 1e-5, as without speculation), and after every update the engine serves
the trainer's weights (--check-weight-update-equal)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.processes import stack_pids

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
ROLLOUTS = 12


def _run(model: Path, prompts: Path, out: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(model), "--prompt-data", str(prompts),
           "--label-key", "label", "--apply-chat-template", "--custom-rm-path", "tests.e2e.mtp_rewards.toward_one_side",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", str(ROLLOUTS),
           "--rollout-num-gpus", "1", "--rollout-max-response-len", "16", "--micro-batch-size", "8", "--lr", "2e-2",
           "--mtp-num-layers", "1", "--vllm-speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
           "--check-weight-update-equal", "--output-dir", str(out), "--vllm-enforce-eager",
           "--vllm-max-model-len", "256", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "train/steps" in r]
    assert [r["rollout_id"] for r in records] == list(range(ROLLOUTS))
    for r in records:
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-5, r
        assert r["weight_check/max_abs_logprob_diff"] <= 1e-5, r
        assert r["rollout/spec_draft_tokens"] > 0
        # one draft token per step: a step yields the policy's token plus the accepted draft
        assert r["rollout/spec_mean_accepted_length"] == pytest.approx(1 + r["rollout/spec_acceptance_rate"])
    return records


def test_a_trained_mtp_drafter_follows_the_policy_and_a_frozen_one_does_not(arithmetic_data, tmp_path):
    from vime.synthetic.tiny_model import build_tiny_model

    assert not stack_pids()
    model = build_tiny_model(tmp_path / "glm", arch="glm4_moe", seed=0, with_mtp=True)
    trained = _run(model, arithmetic_data[0], tmp_path / "trained", "--enable-mtp-training",
                   "--mtp-loss-scaling-factor", "1.0", "--update-weight-transport", "broadcast")
    frozen = _run(model, arithmetic_data[0], tmp_path / "frozen")
    rate = {name: [r["rollout/spec_acceptance_rate"] for r in records]
            for name, records in (("trained", trained), ("frozen", frozen))}
    print("acceptance, trained:", [round(x, 3) for x in rate["trained"]])
    print("acceptance, frozen: ", [round(x, 3) for x in rate["frozen"]])
    for records in (trained, frozen):  # the policy moved alike: from near uniform to a few tokens
        assert records[-1]["rollout/reward_mean"] >= 0.9 > records[0]["rollout/reward_mean"] + 0.2
    assert max(rate["trained"][:2]) <= 0.05 and min(rate["trained"][-3:]) >= 0.5
    assert max(rate["frozen"]) <= 0.05
    assert trained[-1]["train/mtp_loss"] < 0.5 * trained[0]["train/mtp_loss"]
    assert "train/mtp_loss" not in frozen[0]
    assert not stack_pids()
