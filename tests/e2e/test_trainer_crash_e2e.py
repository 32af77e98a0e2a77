"""Trainer crash recovery with the straw data buffer, on the real stack (tiny model, 1 vLLM engine behind
vllm-router, Megatron-core, Ray).

A run checkpoints every 2 rollouts. Once the checkpoint of rollout 1 exists and rollout 2 is stored in the straw
directory, the whole process tree is SIGKILLed; the restart with --load trains rollout 2 from storage (not
generated again) and continues with rollout 3. The sample ids trained over the whole run must be exactly an
uninterrupted run's: none lost, none trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.e2e.processes import stack_pids

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT, GROUPS, PER_PROMPT, SEED = 4, 4, 4, 1234


def _cmd(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(model), "--prompt-data", str(data),
        "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rollout-seed", str(SEED),
        "--rm-type", "random", "--rollout-batch-size", str(GROUPS), "--n-samples-per-prompt", str(PER_PROMPT),
        "--num-rollout", str(NUM_ROLLOUT), "--rollout-num-gpus", "1", "--rollout-max-response-len", "16",
        "--micro-batch-size", "8", "--lr", "1e-2", "--save", str(out / "ckpt"), "--save-interval", "2",
        "--rollout-data-transport", "straw", "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.jsonl"),
        "--output-dir", str(out / "run"), "--vllm-enforce-eager", "--vllm-dtype", "float32",
        "--vllm-max-model-len", "256", *extra,
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


def _kill_after_checkpoint_and_a_stored_rollout(cmd: list[str], out: Path) -> None:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    tracker = out / "ckpt" / "latest_checkpointed_iteration.txt"
    stored = out / "run" / "rollout_data" / "index" / "rollout_00000002.json"
    try:
        deadline = time.monotonic() + 300
        while not (tracker.exists() and tracker.read_text().strip() == "1" and stored.exists()):
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint of rollout 1 and stored rollout 2 within 5 minutes"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, the trainer, the manager, the engines: no clean-up
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while stack_pids() and time.monotonic() < deadline:
        time.sleep(1)
    assert not stack_pids(), "engines or router outlived a SIGKILLed run"


def test_sigkilled_trainer_resumes_and_replays_stored_rollouts(tiny_qwen3, arithmetic_data, tmp_path):
    assert not stack_pids()
    data = arithmetic_data[0]
    _kill_after_checkpoint_and_a_stored_rollout(_cmd(tiny_qwen3, data, tmp_path), tmp_path)
    trained_before = [json.loads(line)["rollout_id"]
                      for line in (tmp_path / "run" / "trained_samples.jsonl").read_text().splitlines()
                      if line.endswith("}")]
    assert trained_before[:2] == [0, 1]

    proc = subprocess.run(_cmd(tiny_qwen3, data, tmp_path, "--load", str(tmp_path / "ckpt")), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]

    expected = _uninterrupted(tiny_qwen3, data)
    records = [json.loads(line) for line in (tmp_path / "run" / "trained_samples.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == list(range(NUM_ROLLOUT))
    assert [r["replayed"] for r in records] == [False, False, True, False]  # rollout 2 came from storage
    trained = [i for r in records for i in r["sample_ids"]]
    assert len(trained) == len(set(trained)) == NUM_ROLLOUT * GROUPS * PER_PROMPT  # nothing trained twice
    assert [r["sample_ids"] for r in records] == [[i for i, _ in rollout] for rollout in expected]
    for rollout_id in range(NUM_ROLLOUT):  # and each id carried the prompt an uninterrupted run gives it
        saved = [json.loads(line) for line in (tmp_path / f"rollout_{rollout_id}.jsonl").read_text().splitlines()]
        assert [(s["index"], s["prompt"]) for s in saved] == expected[rollout_id]

    resumed = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["rollout_id"]: r for r in resumed if "train/steps" in r and r["rollout_id"] >= 2}
    assert resumed[2]["buffer/replayed"] == 1.0 and resumed[3]["buffer/replayed"] == 0.0
    assert not list((tmp_path / "run" / "rollout_data" / "index").iterdir())  # trimmed after the last checkpoint
    assert not stack_pids()
