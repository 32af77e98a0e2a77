"""Trainer crash recovery with the straw data buffer, on the real stack (tiny model, 1 vLLM engine behind
vllm-router, Megatron-core, Ray).

A run checkpoints every 2 rollouts (the kill and resume of the whole loop: the test of (a) also checks GSPO's
advantages, every weight update and the on-policy gap over both runs, and that a run over a killed run's state is
refused). Its rollout 3 waits (tests/e2e/crash_hold_plugin.py) until the test has struck,
so the run has then written the checkpoint of rollout 1 and stored and trained rollout 2. (a) The whole run's process
tree is SIGKILLed, and the restart with --load trains rollout 2 from storage (not generated again) and generates
rollout 3; (b) only the training actor's process tree is SIGKILLed, and the same run restarts its trainer from the
checkpoint while the engines keep serving, in continuous asynchronous mode (train_async.py --max-staleness 2:
rollouts generated ahead, weights updated in flight). Either way the sample ids trained over the whole run must be
exactly an uninterrupted run's: none lost, none trained twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import psutil

from tests.e2e.crash_hold_plugin import FUNCTION_PATH, held_run_env, wait_until_held
from tests.e2e.processes import stack_pids
from tests.helpers.advantage_reference import check_grpo_stats
from vime.rollout.debug_data import load_rollout

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT, GROUPS, PER_PROMPT, SEED = 4, 4, 4, 1234


def _cmd(model: Path, data: Path, out: Path, *extra: str, entry: str = "train.py") -> list[str]:
    return [
        sys.executable, str(REPO / entry), "--hf-checkpoint", str(model), "--prompt-data", str(data),
        "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rollout-seed", str(SEED),
        "--rm-type", "random", "--rollout-batch-size", str(GROUPS), "--n-samples-per-prompt", str(PER_PROMPT),
        "--num-rollout", str(NUM_ROLLOUT), "--rollout-num-gpus", "1", "--rollout-max-response-len", "16",
        "--micro-batch-size", "8", "--lr", "1e-2", "--save", str(out / "ckpt"), "--save-interval", "2",
        "--rollout-data-transport", "straw", "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.jsonl"),
        "--output-dir", str(out / "run"), "--vllm-enforce-eager", "--vllm-dtype", "float32",
        "--vllm-max-model-len", "256", "--rollout-function-path", FUNCTION_PATH, *extra,
    ]


def _uninterrupted(model: Path, data: Path) -> list[list[tuple[int, str]]]:
    """(sample id, prompt) of every sample an uninterrupted run trains, per rollout, from the data source alone."""
    from transformers import AutoTokenizer

    from vime.data.data_source import RolloutDataSource
    from vime.data.prompt_dataset import load_prompt_samples

    args = SimpleNamespace(input_key="prompt", label_key="label", metadata_key="metadata", tool_key=None,
                           apply_chat_template=True, apply_chat_template_kwargs=None, rollout_max_prompt_len=None)
    source = RolloutDataSource(load_prompt_samples(data, AutoTokenizer.from_pretrained(model), args), PER_PROMPT,
                               seed=SEED, shuffle=True)
    return [[(s.index, s.prompt) for g in source.get_samples(GROUPS) for s in g] for _ in range(NUM_ROLLOUT)]


def _start(cmd: list[str], out: Path, hold: Path | None = None) -> subprocess.Popen:
    """The run in its own process group, its log in a file (a pipe nobody reads would block it). With `hold`, the
    run's rollout 3 waits while that file exists."""
    log = open(out / "train.log", "a")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=held_run_env(hold, at=3))


def _log_tail(out: Path) -> str:
    return (out / "train.log").read_text()[-6000:]


def _wait_until_held(proc: subprocess.Popen, hold: Path, out: Path) -> None:
    """Until the run waits before rollout 3: checkpoint 1 written, rollout 2 stored and trained."""
    wait_until_held(proc, hold, lambda: _log_tail(out))
    assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert _stored(out) == {2}  # rollouts 0 and 1 are in the checkpoint, so storage let them go


def _stored(out: Path) -> set[int]:
    index = out / "run" / "rollout_data" / "index"
    return {int(p.stem.rsplit("_", 1)[1]) for p in index.glob("rollout_*.json")}


def _kill_before_rollout_3(cmd: list[str], out: Path) -> None:
    proc = _start(cmd, out, hold=out / "hold")
    try:
        _wait_until_held(proc, out / "hold", out)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, the trainer, the manager, the engines: no clean-up
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _wait_for_no_stack()


def _wait_for_no_stack() -> None:
    deadline = time.monotonic() + 60
    while stack_pids() and time.monotonic() < deadline:
        time.sleep(1)
    assert not stack_pids(), "engines or router outlived a SIGKILLed run"


def test_sigkilled_trainer_resumes_and_replays_stored_rollouts(tiny_qwen3, arithmetic_data, tmp_path):
    """Also, over both runs (GSPO): every weight update's check passes, training is on-policy (the replayed
    rollout 2 was generated with the checkpoint's weights), the reported advantage statistics are GSPO's from the
    saved rollouts; and between them a fresh run over the killed run's state, or one whose --load holds no
    checkpoint, is refused before it starts anything."""
    assert not stack_pids()
    data = arithmetic_data[0]
    checked = ("--advantage-estimator", "gspo", "--check-weight-update-equal")
    _kill_before_rollout_3(_cmd(tiny_qwen3, data, tmp_path, *checked), tmp_path)
    trained_before = [json.loads(line)["rollout_id"]
                      for line in (tmp_path / "run" / "trained_samples.jsonl").read_text().splitlines()
                      if line.endswith("}")]
    assert trained_before == [0, 1, 2]  # rollout 2 was trained, but after the checkpoint
    empty, other = tmp_path / "empty", tmp_path / "other"
    empty.mkdir()
    # side by side (each is start-up and a refusal): a fresh run (no --load) over the killed run's state, and one
    # whose --load holds no checkpoint
    fresh, nothing = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                       env=held_run_env(None))
                      for cmd in (_cmd(tiny_qwen3, data, tmp_path), _cmd(tiny_qwen3, data, other, "--load", str(empty))))
    for refused, says in ((fresh, "earlier run's state"), (nothing, f"--load {empty}: no checkpoint")):
        stderr = refused.communicate(timeout=300)[1]
        assert refused.returncode != 0 and says in stderr, stderr[-3000:]
    assert not (other / "run" / "metrics.jsonl").exists()  # it failed before anything started
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"

    proc = _start(_cmd(tiny_qwen3, data, tmp_path, "--load", str(tmp_path / "ckpt"), *checked), tmp_path)  # no hold
    try:
        assert proc.wait(timeout=600) == 0, _log_tail(tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    records = _check_trained_samples_equal_an_uninterrupted_run(tiny_qwen3, data, tmp_path)
    assert [r["replayed"] for r in records] == [False, False, True, False]  # rollout 2 came from storage
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # one row per rollout: the killed run's row of rollout 2 (after its checkpoint) gave way to the redone one
    assert [r["rollout_id"] for r in rows if "train/steps" in r] == list(range(NUM_ROLLOUT))
    resumed = {r["rollout_id"]: r for r in rows if "train/steps" in r and r["rollout_id"] >= 2}
    assert resumed[2]["buffer/replayed"] == 1.0 and resumed[3]["buffer/replayed"] == 0.0
    for r in (r for r in rows if "train/steps" in r):
        assert r["weight_check/max_abs_logprob_diff"] < 1e-5, r
        assert r["train_rollout_logprob_abs_diff"] < 1e-5, r
        check_grpo_stats(r, load_rollout(str(tmp_path / "rollout_{rollout_id}.jsonl"), r["rollout_id"]))
    assert any(r["train/grad_norm"] > 0 for r in rows if "train/steps" in r)  # the weights really moved
    assert not stack_pids()


def _check_trained_samples_equal_an_uninterrupted_run(model: Path, data: Path, out: Path) -> list[dict]:
    expected = _uninterrupted(model, data)
    records = [json.loads(line) for line in (out / "run" / "trained_samples.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == list(range(NUM_ROLLOUT))
    trained = [i for r in records for i in r["sample_ids"]]
    assert len(trained) == len(set(trained)) == NUM_ROLLOUT * GROUPS * PER_PROMPT  # nothing trained twice
    assert [r["sample_ids"] for r in records] == [[i for i, _ in rollout] for rollout in expected]
    for rollout_id in range(NUM_ROLLOUT):  # and each id carried the prompt an uninterrupted run gives it
        saved = [json.loads(line) for line in (out / f"rollout_{rollout_id}.jsonl").read_text().splitlines()]
        assert [(s["index"], s["prompt"]) for s in saved] == expected[rollout_id]
    assert not list((out / "run" / "rollout_data" / "index").iterdir())  # trimmed after the last checkpoint
    return records


def _trainer_trees(root_pid: int) -> list[psutil.Process]:
    """The training actors under `root_pid` and everything they started."""
    actors = [p for p in psutil.Process(root_pid).children(recursive=True)
              if any("TrainActor" in part for part in _cmdline(p))]
    return [q for p in actors for q in [p, *p.children(recursive=True)]]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _wait_until_rollout_2_is_logged(proc: subprocess.Popen, hold: Path, out: Path) -> None:
    """Continuous mode: the manager holds rollout 3's generation while the driver still trains and saves the
    rollouts generated ahead of it; wait until rollout 2 is trained, its weights sent and its metrics row written
    (the driver then waits for rollout 3), with checkpoint 1 written and rollout 2 stored."""
    wait_until_held(proc, hold, lambda: _log_tail(out))
    metrics, deadline = out / "run" / "metrics.jsonl", time.monotonic() + 300
    while not any(json.loads(line).get("rollout_id") == 2 and "train/steps" in line
                  for line in (metrics.read_text().splitlines() if metrics.exists() else [])):
        assert proc.poll() is None, _log_tail(out)
        assert time.monotonic() < deadline, "rollout 2 was not trained within 5 minutes"
        time.sleep(0.2)
    assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert _stored(out) == {2}


def test_sigkilled_training_actor_is_restarted_in_process_while_engines_keep_serving(tiny_qwen3, arithmetic_data,
                                                                                     tmp_path):
    """Continuous mode (--max-staleness 2): the engines generate two rollouts ahead and take every update in
    flight. The training actor dies after training rollout 2 (checkpoint 1); rollout 3, generated meanwhile, finds
    it dead, and the restarted trainer replays rollout 2 from storage before training 3."""
    assert not stack_pids()
    data = arithmetic_data[0]
    hold = tmp_path / "hold"
    proc = _start(_cmd(tiny_qwen3, data, tmp_path, "--max-staleness", "2", entry="train_async.py"), tmp_path,
                  hold=hold)
    try:
        _wait_until_rollout_2_is_logged(proc, hold, tmp_path)
        engines = stack_pids()
        victims = _trainer_trees(proc.pid)
        assert victims, "no TrainActor process found under the run"
        for p in victims:
            p.kill()  # SIGKILL, no clean-up
        hold.unlink()  # rollout 3 goes on; training it finds the trainer dead
        metrics_path = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while "recovery/trainer_restarts" not in (metrics_path.read_text() if metrics_path.exists() else ""):
            assert proc.poll() is None, _log_tail(tmp_path)
            assert time.monotonic() < deadline, "the trainer was not restarted within 5 minutes"
            time.sleep(0.2)
        assert proc.wait(timeout=300) == 0, _log_tail(tmp_path)
        # the same engine served the whole run: one server start in its log (a restart appends another), by one of
        # the processes seen before the kill (checking they are alive now would race the run's end)
        log = (tmp_path / "run" / "logs" / "engine_0.log").read_text()
        starts = re.findall(r"Started server process \[(\d+)\]", log)
        assert len(starts) == 1 and int(starts[0]) in engines, (starts, engines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _wait_for_no_stack()
    _check_trained_samples_equal_an_uninterrupted_run(tiny_qwen3, data, tmp_path)
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert max(r.get("recovery/trainer_restarts", 0) for r in rows) == 1.0
    trained = [r for r in rows if "train/steps" in r]
    assert [r["rollout_id"] for r in trained] == list(range(NUM_ROLLOUT))
    assert all(r["async/stale_samples_dropped"] == 0.0 and r["async/staleness_max"] <= 2.0 for r in trained), trained
