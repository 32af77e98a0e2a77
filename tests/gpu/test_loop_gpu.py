"""The loop end to end on GPUs with vLLM's CUDA build (skipped without a GPU, or without vLLM, Ray and vllm-router,
or where vLLM is its CPU build): `train.py` on a tiny random Qwen3, 3 rollouts, as tests/e2e/test_loop_e2e.py runs
it on CPU, with --check-weight-update-equal (a failed check stops the run).

- One GPU: trainer and engine colocated (--colocate), taking turns with --offload-rollout (the engine sleeps: vime
  starts it in vLLM's sleep mode and sizes its share of the GPU) and --offload-train, weights through CUDA IPC,
  bfloat16.
- Two GPUs (skipped with one): disaggregated, a GPU each, weights over NCCL (broadcast), float32.

Each run must report, for every rollout: one or more optimizer steps, a weight check within vime's tolerance for
the dtype (`vime.utils.tolerances`), a train/rollout log-prob gap (the trainer's log-probs of the engine's own
samples, on-policy) within the same, and rewards. --vllm-enforce-eager skips CUDA graph capture at start-up.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]
CASES = {
    "colocated-offload-1gpu": (1, "bfloat16", ["--colocate", "--offload-rollout", "--offload-train",
                                               "--update-weight-transport", "cuda_ipc", "--bf16"]),
    "disaggregated-2gpu": (2, "float32", ["--update-weight-transport", "broadcast"]),
}


def why_no_loop() -> str | None:
    """Why the loop cannot run in this environment (a skip reason), or None."""
    import importlib.util

    for module in ("vllm", "ray", "vllm_router", "straw"):
        if importlib.util.find_spec(module) is None:
            return f"needs {module} (not installed here)"
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # noqa: BLE001 - any import failure means no vLLM to run
        return f"vllm does not import here: {type(e).__name__}: {e}"
    if not current_platform.is_cuda():
        return f"vllm here is not its CUDA build (platform: {type(current_platform).__name__})"
    return None


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("case", CASES)
def test_loop_end_to_end(tiny_qwen3, arithmetic_data, tmp_path, case):
    from vime.utils.tolerances import tolerance

    gpus, dtype, extra = CASES[case]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")
    reason = why_no_loop()
    if reason:
        pytest.skip(reason)
    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(tiny_qwen3),
           "--prompt-data", str(arithmetic_data[0]), "--label-key", "label", "--apply-chat-template",
           "--rollout-shuffle", "--rm-type", "random", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
           "--num-rollout", "3", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1",
           "--rollout-max-response-len", "16", "--micro-batch-size", "8", "--lr", "1e-2",
           "--check-weight-update-equal", "--output-dir", str(tmp_path / "run"),
           "--vllm-enforce-eager", "--vllm-max-model-len", "256", *extra]
    log = tmp_path / "train.log"
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=240, cwd=REPO)
        except subprocess.TimeoutExpired:
            pytest.fail(f"train.py did not finish within 240 s:\n{log.read_text()[-8000:]}")
    assert proc.returncode == 0, f"train.py exited with {proc.returncode}:\n{log.read_text()[-8000:]}"

    absolute, relative = tolerance("logprob", dtype, "cuda"), tolerance("logprob_relative", dtype, "cuda")
    train = [r for r in _metrics(tmp_path / "run") if "train/steps" in r]
    assert [r["rollout_id"] for r in train] == [0, 1, 2]
    for r in train:
        assert r["train/steps"] >= 1, r
        # vime's own check passed (the run went on); its bound allows `relative` x |log-prob| on top (probe ~ -30)
        assert 0 <= r["weight_check/max_abs_logprob_diff"] <= absolute + 30 * relative, r
        assert 0 <= r["train_rollout_logprob_abs_diff"] <= absolute, r  # on-policy: the engine's samples
        assert math.isfinite(r["rollout/reward_mean"]) and r["rollout/num_samples"] == 16, r
    assert any(r["train/grad_norm"] > 0 for r in train)  # the weights really moved
