"""Per-phase time of one RL step with the quickstart's GRPO config, and sync vs async step time.

    .venv/bin/python bench/step_breakdown.py [--rollouts 6]

Runs train.py and then train_async.py on the same tiny model and data (real vLLM engines, vllm-router,
Megatron-core, Ray) and reads their metrics.jsonl. The first rollout (compilation, warm-up) is left out.
Prints each phase's mean seconds per step, and async step time / max(rollout time, train time)
(target <= 1.15: the overlap hides the shorter phase).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("rollout/time", "perf/train_time", "perf/update_weights_time", "perf/step_time")


def run(entry: str, model: Path, data: Path, out: Path, rollouts: int) -> list[dict]:
    cmd = [sys.executable, str(REPO / entry), "--hf-checkpoint", str(model), "--prompt-data", str(data),
           "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math",
           "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "24",
           "--micro-batch-size", "32", "--lr", "5e-4", "--rollout-num-gpus", "2", "--vllm-dtype", "float32",
           "--vllm-max-model-len", "256", "--num-rollout", str(rollouts), "--output-dir", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "perf/step_time" in r][1:]  # drop the warm-up step


def mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=6)
    a = p.parse_args()
    sys.path.insert(0, str(REPO))
    from vime.synthetic.arithmetic_data import write_arithmetic_data
    from vime.synthetic.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="vime_steps_"))
    model = build_tiny_model(work / "model", arch="qwen3", hidden_size=256, num_layers=4, num_heads=4,
                             num_kv_heads=2, intermediate_size=768)
    train_data, _ = write_arithmetic_data(work / "data", n_train=512, n_eval=8, task="repeat")
    results = {name: run(entry, model, train_data, work / name, a.rollouts)
               for name, entry in (("sync", "train.py"), ("async", "train_async.py"))}
    print(f"{'phase (s/step)':<28}{'sync':>10}{'async':>10}")
    for key in PHASES:
        print(f"{key:<28}{mean(results['sync'], key):>10.3f}{mean(results['async'], key):>10.3f}")
    sync_step, async_step = mean(results["sync"], "perf/step_time"), mean(results["async"], "perf/step_time")
    longest = max(mean(results["async"], "rollout/time"), mean(results["async"], "perf/train_time"))
    print(f"async step / sync step: {async_step / sync_step:.3f}")
    print(f"async step / max(rollout, train): {async_step / longest:.3f}  (target <= 1.15)")


if __name__ == "__main__":
    main()
