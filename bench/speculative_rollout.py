"""Speculative rollout on this machine: generation tokens/s of one bare vLLM engine (vLLM's offline `LLM`, vime's
plugin loaded), without speculation and drafting K tokens a step with the checkpoint's own MTP layer, for

  (a) a random tiny GLM-4.5 with one MTP layer: a random layer's greedy draft is almost never accepted, so this
      is what drafting costs;
  (b) the same model after GRPO rollouts through train.py with --enable-mtp-training on a reward that makes the
      policy nearly deterministic (`tests/e2e/mtp_rewards.py`), saved with --save-hf: a drafter trained along
      with the policy.

Prints per checkpoint and K: tokens/s, the ratio to the same checkpoint without speculation (measured in the same
run), and the acceptance rate (accepted / proposed draft tokens, from the engine's counters).

    .venv/bin/python bench/speculative_rollout.py [--rollouts 12 --prompts 32 --max-tokens 64 --k 1 2]

Each measurement is a process of its own (one engine at a time), best of --repeats timed generations after a
warm-up. A tiny model on a CPU is dominated by per-step overhead, not by the matmuls speculation saves on a GPU:
read the ratios as this machine's, not as a forecast for a large model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measure(checkpoint: str, k: int, prompts: int, max_tokens: int, repeats: int) -> dict:
    """Runs in its own process: tokens/s and acceptance of one engine on `checkpoint` drafting `k` tokens (0: no
    speculation)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vime.synthetic.arithmetic_data import write_arithmetic_data

    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}
    llm = LLM(checkpoint, dtype="float32", enforce_eager=True, max_model_len=512, seed=0, disable_log_stats=False,
              **spec)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [json.loads(line) for line in write_arithmetic_data(Path(tmp), prompts, 1, seed=0)[0].open()]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                           add_generation_prompt=True) for r in rows]
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens, seed=i)
              for i in range(len(texts))]
    llm.generate(texts[:4], params[:4], use_tqdm=False)  # warm-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(texts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    counts = {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
              if m.name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}
    drafted = counts.get("num_draft_tokens", 0)
    return {"tokens_per_s": best, "acceptance": counts.get("num_accepted_tokens", 0) / drafted if drafted else None}


def train(model: Path, out: Path, rollouts: int) -> Path:
    """GRPO rollouts with the MTP layer trained alongside (speculative rollout on); the final weights as HF."""
    from vime.synthetic.arithmetic_data import write_arithmetic_data

    data, _ = write_arithmetic_data(out / "data", n_train=64, n_eval=4, seed=0)
    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(model), "--prompt-data", str(data),
           "--label-key", "label", "--apply-chat-template", "--custom-rm-path",
           "tests.e2e.mtp_rewards.toward_one_side", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
           "--num-rollout", str(rollouts), "--rollout-num-gpus", "1", "--rollout-max-response-len", "16",
           "--micro-batch-size", "8", "--lr", "2e-2", "--mtp-num-layers", "1", "--enable-mtp-training",
           "--mtp-loss-scaling-factor", "1.0", "--vllm-speculative-config",
           '{"method": "mtp", "num_speculative_tokens": 1}', "--output-dir", str(out / "run"),
           "--save-hf", str(out / "trained_hf"), "--vllm-enforce-eager", "--vllm-max-model-len", "256"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        sys.exit(f"training failed:\n{proc.stderr[-4000:]}")
    last = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    print(f"trained {rollouts} rollouts: last reward {last.get('rollout/reward_mean', float('nan')):.3f}, "
          f"acceptance in the run {last.get('rollout/spec_acceptance_rate', float('nan')):.3f}")
    return out / "trained_hf"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=12)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--measure", nargs=2, metavar=("CHECKPOINT", "K"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure:
        print("RESULT", json.dumps(measure(a.measure[0], int(a.measure[1]), a.prompts, a.max_tokens, a.repeats)))
        return
    from vime.synthetic.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        random = build_tiny_model(out / "random", arch="glm4_moe", seed=0, with_mtp=True)
        trained = train(random, out, a.rollouts)
        print(f"{'checkpoint':<10} {'K':>2} {'tokens/s':>9} {'vs K=0':>7} {'acceptance':>10}")
        for name, checkpoint in (("random", random), ("trained", trained)):
            base = None
            for k in [0, *a.k]:
                proc = subprocess.run([sys.executable, __file__, "--measure", str(checkpoint), str(k),
                                       "--prompts", str(a.prompts), "--max-tokens", str(a.max_tokens),
                                       "--repeats", str(a.repeats)], capture_output=True, text=True, cwd=REPO)
                if proc.returncode:
                    sys.exit(f"measuring {name} K={k} failed:\n{proc.stderr[-4000:]}")
                result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
                base = base or result["tokens_per_s"]
                rate = "-" if result["acceptance"] is None else f"{result['acceptance']:.3f}"
                print(f"{name:<10} {k:>2} {result['tokens_per_s']:>9.0f} {result['tokens_per_s'] / base:>7.2f} "
                      f"{rate:>10}", flush=True)


if __name__ == "__main__":
    main()
