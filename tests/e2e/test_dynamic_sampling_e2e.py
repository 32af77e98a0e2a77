"""Over-sampling with dynamic sampling and partial rollout, with eval, on the real stack (1 vLLM engine behind
vllm-router, Megatron-core, Ray): one run of 3 rollouts, checked from its metrics, saved rollouts, trained
sample ids and reward curve.

Each rollout submits 8 groups for a batch of 4; `check_reward_nonzero_std` drops the groups whose (random) rewards
are all equal; once 4 groups passed, the engine aborts the rest (`/abort_requests`) and, with --partial-rollout,
their tokens so far are kept and continued first in the next rollout (--mask-offpolicy-in-partial-rollout keeps
the tokens of the older weights out of the loss). Stop tokens (a tenth of the vocabulary) make response lengths
vary, so groups finish at different times and some are still generating when the batch fills."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.e2e.processes import stack_pids
from tests.helpers.advantage_reference import check_grpo_stats
from vime.data.sample import Sample
from vime.rollout.debug_data import load_rollout
from vime.utils.plot import SERIES_KEY

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT, BATCH, OVER_SAMPLING, GROUP = 3, 4, 8, 4
STOP_IDS = [str(i) for i in range(100, 151)]


@pytest.fixture(scope="module")
def run(tiny_qwen3, arithmetic_data, tmp_path_factory):
    assert not stack_pids(), "engine or router processes are already running"
    out = tmp_path_factory.mktemp("dynamic_sampling")
    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3),
           "--prompt-data", str(arithmetic_data[0]), "--label-key", "label", "--apply-chat-template",
           "--rm-type", "random", "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(GROUP),
           "--over-sampling-batch-size", str(OVER_SAMPLING),
           "--dynamic-sampling-filter-path",
           "vime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
           "--partial-rollout", "--mask-offpolicy-in-partial-rollout",
           "--rollout-max-response-len", "48", "--rollout-stop-token-ids", *STOP_IDS,
           "--num-rollout", str(NUM_ROLLOUT), "--rollout-num-gpus", "1", "--micro-batch-size", "8", "--lr", "1e-3",
           "--eval-prompt-data", "arith", str(arithmetic_data[1]), "--eval-interval", "2",
           "--eval-function-path", "vime.rollout.vllm_rollout.generate_rollout", "--n-samples-per-eval-prompt", "2",
           "--eval-max-response-len", "8", "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.jsonl"),
           "--output-dir", str(out / "run"), "--vllm-enforce-eager", "--vllm-max-model-len", "256"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [load_rollout(str(out / "rollout_{rollout_id}.jsonl"), i) for i in range(NUM_ROLLOUT)]
    return out, records, rollouts, stack_pids()


def _by_rollout(records: list[dict], key: str) -> dict[int, dict]:
    return {r["rollout_id"]: r for r in records if key in r}


def test_every_batch_is_full_of_passing_finished_groups(run):
    _, records, rollouts, left = run
    assert not left, f"processes left after the run: {left}"
    for groups in rollouts:
        assert len(groups) == BATCH and all(len(g) == GROUP for g in groups)
        for g in groups:
            assert all(s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED) for s in g)
            assert len({s.reward for s in g}) > 1  # the filter's verdict: no zero-std group got through
    stats = _by_rollout(records, "rollout/submitted_groups")
    assert sorted(stats) == list(range(NUM_ROLLOUT))
    for r in stats.values():
        dropped = sum(v for k, v in r.items() if k.startswith("rollout/dropped/"))
        assert r["rollout/dropped_groups"] == dropped
    total = {k: sum(r[f"rollout/{k}"] for r in stats.values()) for k in ("dropped_groups", "aborted_groups")}
    print(f"dynamic sampling: {total}, per rollout "
          f"{[(r['rollout/submitted_groups'], r['rollout/aborted_groups']) for r in stats.values()]}")
    assert total["aborted_groups"] > 0, "no group was still generating when a batch filled: nothing aborted"
    assert total["dropped_groups"] > 0, "the filter dropped nothing: its path is untested"


def test_no_aborted_or_dropped_sample_is_trained(run):
    out, records, rollouts, _ = run
    trained = [json.loads(line) for line in (out / "run" / "trained_samples.jsonl").read_text().splitlines()]
    assert [t["rollout_id"] for t in trained] == list(range(NUM_ROLLOUT))
    for t, groups in zip(trained, rollouts):
        assert sorted(t["sample_ids"]) == sorted(s.index for g in groups for s in g)
    for r in _by_rollout(records, "train/steps").values():
        assert r["train/num_usable_samples"] == BATCH * GROUP and r["train/grad_norm"] > 0
        check_grpo_stats(r, rollouts[r["rollout_id"]])  # over the trainable tokens only


def test_aborted_samples_continue_from_their_tokens(run):
    """A resumed sample keeps the tokens generated before the abort, under the weights of its first rollout (loss
    mask 0 there), and continues under the next weights (loss mask 1, a second weight version)."""
    _, _, rollouts, _ = run
    resumed = [s for groups in rollouts[1:] for g in groups for s in g
               if s.metadata.get("partial_rollout_resumed")]
    assert resumed, "no aborted sample was continued in a later rollout"
    for s in resumed:
        kept = s.loss_mask.index(1) if 1 in s.loss_mask else s.response_length
        assert kept > 0 and s.loss_mask == [0] * kept + [1] * (s.response_length - kept), s.loss_mask
        assert len(s.rollout_log_probs) == s.response_length and all(lp <= 0 for lp in s.rollout_log_probs)
        assert len(s.weight_versions) == 2, s.weight_versions  # begun under one policy, finished under the next
    kept = [s.loss_mask.count(0) for s in resumed]
    print(f"partial rollout: {len(resumed)} samples resumed, pre-abort tokens {kept}")


def test_eval_runs_on_its_own_data_and_the_reward_curve_shows_it(run, arithmetic_data):
    out, records, _, _ = run
    evals = _by_rollout(records, "eval/arith/reward_mean")
    num_eval = sum(1 for line in arithmetic_data[1].read_text().splitlines() if line.strip())
    assert sorted(evals) == [0, 2, NUM_ROLLOUT]  # before rollouts 0 and 2 (--eval-interval 2), after the last
    assert all(r["eval/arith/num_samples"] == 2 * num_eval for r in evals.values()), evals
    path = out / "run" / "reward_curve.png"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        series = json.loads(image.text[SERIES_KEY])
    rollout_points = [[r["rollout_id"], r["rollout/reward_mean"]] for r in records if "rollout/reward_mean" in r]
    assert series["rollout/reward_mean"] == rollout_points
    assert series["eval/arith/reward_mean"] == [[i, evals[i]["eval/arith/reward_mean"]] for i in sorted(evals)]


def test_saved_rollouts_replay_to_the_same_training(run, tiny_qwen3):
    """--debug-train-only --load-debug-rollout-data on the run's saved rollouts (no engine): the same samples, in
    the same order, from the same weights give the same training, rollout after rollout."""
    out, records, _, _ = run
    replay = out / "replay"
    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3), "--debug-train-only",
           "--load-debug-rollout-data", str(out / "rollout_{rollout_id}.jsonl"), "--rm-type", "random",
           "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(GROUP), "--num-rollout", str(NUM_ROLLOUT),
           "--micro-batch-size", "8", "--lr", "1e-3", "--output-dir", str(replay)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    replayed = _by_rollout([json.loads(line) for line in (replay / "metrics.jsonl").read_text().splitlines()],
                           "train/steps")
    original = _by_rollout(records, "train/steps")
    assert sorted(replayed) == sorted(original) == list(range(NUM_ROLLOUT))
    for i in original:
        for key in ("train/pg_loss", "train/grad_norm", "train/entropy", "train/advantage_mean",
                    "train_rollout_logprob_abs_diff"):
            assert replayed[i][key] == pytest.approx(original[i][key], abs=1e-5), (i, key)
