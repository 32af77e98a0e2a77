"""The synchronous loop, one-ahead async and continuous async (K = 1, 2, 4) on one long-tail workload, side by
side in one run.

    .venv/bin/python bench/async_modes.py [--rollouts 6] [--ks 1 2 4]

The workload (one engine, one training rank, this machine's CPUs): the 20M-parameter Qwen3 of bench/e2e_step.py
(random init, vocab 8192), 16 prompts x 8 samples per rollout, temperature 1, one optimizer step per rollout, a fixed
reward (the share of even token ids). Long tail: a response ends at the end-of-sequence token or its length cap,
`--short` tokens (32) for nine samples in ten and 8x that (256) for every tenth (`async_modes_plugin.generate`,
by sample index), so a synchronous batch waits for its longest sample.

Each mode runs `--rollouts` rollouts; the first is left out of every figure (warm-up). Printed per mode: trained
samples per second over the loop's wall time (the sum of its step times), the engines' idle fraction (1 - time
spent generating rollouts / wall time), the trainer's idle fraction (train.py: generation and weight sync are the
trainer's idle time; train_async.py: its `perf/trainer_idle_fraction`, the wait for a rollout), the mean and
largest per-token staleness, and each mode's throughput over the synchronous loop's and the one-ahead loop's.
On this 2-core machine the engine and the trainer share the cores, so overlapping them buys less than on separate
devices, where generation and training would each run at full speed at once. A benchmark, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from e2e_step import PROMPTS, SAMPLES, build_model, env, write_prompts  # noqa: E402

REPO = BENCH.parent


def run(entry: str, model: Path, data: Path, out: Path, rollouts: int, short: int, *extra: str) -> list[dict]:
    cmd = [sys.executable, str(REPO / entry), "--hf-checkpoint", str(model), "--prompt-data", str(data),
           "--input-key", "prompt", "--custom-rm-path", "e2e_step_plugin.reward",
           "--custom-generate-function-path", "async_modes_plugin.generate",
           "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES),
           "--rollout-max-response-len", str(8 * short), "--rollout-temperature", "1.0",
           "--micro-batch-size", "16", "--global-batch-size", str(PROMPTS * SAMPLES), "--lr", "1e-5",
           "--rollout-num-gpus", "1", "--vllm-max-model-len", "512", "--vllm-enforce-eager",
           "--num-rollout", str(rollouts), "--output-dir", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**env(), "VIME_PROGRESS": "0", "BENCH_SHORT": str(short)})
    if proc.returncode:
        raise SystemExit(f"{entry} {' '.join(extra)} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(records: list[dict], sync: bool) -> dict[str, float]:
    steps = [r for r in records if "train/steps" in r and r["rollout_id"] > 0]
    wall = sum(r["perf/step_time"] for r in steps)
    generating = sum(r.get("rollout/time", 0.0) for r in steps)
    if sync:  # the trainer waits while the engines generate and while the weights go over
        trainer_idle = sum(r.get("rollout/time", 0.0) + r.get("perf/update_weights_time", 0.0) for r in steps) / wall
    else:
        trainer_idle = sum(r["perf/trainer_idle_fraction"] * r["perf/step_time"] for r in steps) / wall
    return {"samples_per_s": len(steps) * PROMPTS * SAMPLES / wall, "engine_idle": max(0.0, 1 - generating / wall),
            "trainer_idle": trainer_idle,
            "staleness_mean": sum(r.get("async/token_staleness_mean", 0.0) for r in steps) / len(steps),
            "staleness_max": max(r.get("async/staleness_max", 0.0) for r in steps),
            "mean_response": sum(r.get("rollout/response_len_mean", 0.0) for r in steps) / len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--short", type=int, default=32)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vime-bench-async-") as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model")
        data = write_prompts(tmp / "prompts.jsonl", PROMPTS * (a.rollouts + 2))
        modes = {"sync (train.py)": ("train.py", ()), "one-ahead (train_async.py)": ("train_async.py", ())}
        modes.update({f"continuous K={k}": ("train_async.py", ("--max-staleness", str(k))) for k in a.ks})
        results = {}
        for name, (entry, extra) in modes.items():
            slug = "".join(c if c.isalnum() else "_" for c in name)
            records = run(entry, model, data, tmp / slug, a.rollouts, a.short, *extra)
            results[name] = summarize(records, sync=entry == "train.py")
            print(f"{name:28s} {results[name]}", flush=True)
    sync, ahead = results["sync (train.py)"]["samples_per_s"], results["one-ahead (train_async.py)"]["samples_per_s"]
    print(f"\n{'mode':28s} {'samples/s':>9s} {'x sync':>7s} {'x 1-ahead':>9s} {'engine idle':>11s} "
          f"{'trainer idle':>12s} {'staleness mean/max':>18s} {'mean len':>8s}")
    for name, r in results.items():
        print(f"{name:28s} {r['samples_per_s']:9.2f} {r['samples_per_s'] / sync:7.2f} "
              f"{r['samples_per_s'] / ahead:9.2f} {r['engine_idle']:11.2f} {r['trainer_idle']:12.2f} "
              f"{r['staleness_mean']:11.2f} / {r['staleness_max']:<4.0f} {r['mean_response']:8.1f}")


if __name__ == "__main__":
    main()
