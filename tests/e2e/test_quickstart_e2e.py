"""The quickstart as a user runs it, reduced (4 GRPO rollouts instead of 20, eval before and after): its script end to
end on the real stack (SFT warm-up with Megatron-core, then GRPO with a vLLM engine behind vllm-router), and the
model learns the task: the held-out eval reward rises by 0.2 or more. The reward curve it leaves is a valid PNG whose
plotted points are the run's metrics."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from tests.e2e.processes import stack_pids
from vime.data.saved_rollouts import match_train_records, read_train_records
from vime.rollout.debug_data import compact_rollout_path, read_compact_rollout
from vime.utils.plot import SERIES_KEY

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT, EVAL_INTERVAL = 4, 4


def test_quickstart_learns_and_draws_its_reward_curve(tmp_path):
    assert not stack_pids()
    env = {**os.environ, "SKIP_INSTALL": "1", "OUT": str(tmp_path), "VIME_PROGRESS": "0",
           "NUM_ROLLOUT": str(NUM_ROLLOUT), "EVAL_INTERVAL": str(EVAL_INTERVAL)}
    # one engine instead of the script's two: a second costs ~12 s of start-up on two cores, and the loop's other
    # tests run two
    proc = subprocess.run(["bash", str(REPO / "examples" / "quickstart" / "run.sh"), "--rollout-num-gpus", "1"],
                          capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert not stack_pids(), f"processes left after the quickstart: {stack_pids()}"

    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["rollout_id"]: r["eval/repeat/reward_mean"] for r in records if "eval/repeat/reward_mean" in r}
    assert sorted(evals) == [0, 4]
    print(f"quickstart eval reward: {evals}")
    assert evals[NUM_ROLLOUT] >= evals[0] + 0.2, evals
    assert [r["rollout_id"] for r in records if "train/steps" in r] == list(range(NUM_ROLLOUT))

    with Image.open(tmp_path / "grpo" / "reward_curve.png") as image:
        image.verify()
    with Image.open(tmp_path / "grpo" / "reward_curve.png") as image:
        series = json.loads(image.text[SERIES_KEY])
    assert series["eval/repeat/reward_mean"] == [[i, evals[i]] for i in sorted(evals)]
    assert series["rollout/reward_mean"] == [[r["rollout_id"], r["rollout/reward_mean"]] for r in records
                                             if "rollout/reward_mean" in r]
    _check_saved_trainer_records(tmp_path / "grpo")


@pytest.mark.skipif(not os.environ.get("VIME_TEST_HYBRID_QUICKSTART"), reason="VIME_TEST_HYBRID_QUICKSTART=1: "
                    "about 2.5 minutes")
def test_hybrid_quickstart_learns(tmp_path):
    """ARCH=qwen3_next: the quickstart's task on a tiny hybrid Qwen3-Next (Gated DeltaNet layers alternating with
    gated attention, MoE), bfloat16 engines and the float32 trainer: the held-out eval reward rises over the run
    (0.74 -> 0.88 measured), the train/rollout gap stays at the engines' bfloat16 rounding."""
    assert not stack_pids()
    env = {**os.environ, "SKIP_INSTALL": "1", "OUT": str(tmp_path), "VIME_PROGRESS": "0", "ARCH": "qwen3_next"}
    proc = subprocess.run(["bash", str(REPO / "examples" / "quickstart" / "run.sh")], capture_output=True, text=True,
                          timeout=1200, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["rollout_id"]: r["eval/repeat/reward_mean"] for r in records if "eval/repeat/reward_mean" in r}
    print(f"hybrid quickstart eval reward: {evals}")
    assert evals[max(evals)] >= evals[0] + 0.1, evals
    assert max(r["train_rollout_logprob_abs_diff"] for r in records if "train/steps" in r) < 1e-2


def _check_saved_trainer_records(run_dir: Path) -> None:
    """The training actor (through Ray) saved its log-probs and advantages of every sample of every rollout beside
    the compact rollout, for the inspector: the log-probs within 1e-3 of the engine's (same weights, float32)."""
    for rollout_id in range(NUM_ROLLOUT):
        samples = read_compact_rollout(compact_rollout_path(run_dir, f"rollout_{rollout_id}"))
        records = match_train_records(samples, read_train_records(run_dir / "rollouts", rollout_id))
        assert len(samples) == 16 * 8 and all(r is not None for r in records), rollout_id
        for sample, record in zip(samples, records):
            assert len(record["advantages"]) == len(record["log_probs"]) == sample["response_length"]
            gaps = [abs(a - b) for a, b, m in zip(record["log_probs"], sample["rollout_log_probs"],
                                                  sample["loss_mask"]) if m]
            assert max(gaps, default=0.0) < 1e-3, (rollout_id, max(gaps))

