"""LoRA against full fine-tuning on the same model, side by side in one process: seconds per GRPO step
(`MegatronTrainer.train`), trainable parameters, optimizer state and gradient buffer bytes, and what a weight sync
sends (today the merged weights: the whole model; the adapters alone for comparison, what adapter-only sync would
send) with the time to gather them.

    .venv/bin/python bench/lora.py [--rank 8 --samples 32 --tokens 128 --repeats 3 --threads 2]

The model is weight_sync.py's 20M one (qwen3, hidden 512, 5 layers). Steps alternate (full, LoRA, full, ...) after
one warm-up each; the median over repeats is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.train_overhead import make_groups  # noqa: E402


def _state_bytes(trainer) -> tuple[int, int, int]:
    """(trainable parameters, optimizer state bytes, gradient buffer bytes) of a trainer."""
    params = [p for m in trainer.model for p in m.parameters() if p.requires_grad]
    opt = trainer.optimizer
    inner = [o.optimizer for o in (getattr(opt, "chained_optimizers", None) or [opt])]
    state = sum(t.numel() * t.element_size() for o in inner for s in o.state.values() for t in s.values()
                if torch.is_tensor(t))
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in params if hasattr(p, "main_grad"))
    return sum(p.numel() for p in params), state, grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from vime.arguments import parse_args
    from vime.backends.megatron_utils.hf_checkpoint import _unwrap
    from vime.backends.megatron_utils.lora import adapted_linears
    from vime.backends.megatron_utils.parallel import destroy_parallel
    from vime.backends.megatron_utils.trainer import MegatronTrainer
    from vime.synthetic.tiny_model import build_tiny_model

    groups = make_groups(a.samples, 4, a.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_tiny_model(Path(tmp) / "model", arch="qwen3", seed=0, hidden_size=512, num_layers=5, num_heads=8,
                              num_kv_heads=4, intermediate_size=2048)
        base = ["--hf-checkpoint", str(hf), "--debug-train-only", "--load-debug-rollout-data", "unused_{rollout_id}.jsonl",
                "--rm-type", "math", "--rollout-batch-size", str(a.samples // 4), "--n-samples-per-prompt", "4",
                "--micro-batch-size", "8", "--train-num-threads", str(a.threads)]
        results = {}
        for label, extra in (("full", []), ("lora", ["--lora-rank", str(a.rank)])):
            trainer = MegatronTrainer(parse_args(base + extra))
            try:
                trainer.train(0, groups)  # warm-up: allocations, Adam state
                times = []
                for r in range(a.repeats):
                    t0 = time.perf_counter()
                    trainer.train(r + 1, groups)
                    times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                sent = sum(t.numel() * t.element_size() for _, t in trainer.hf_weights())
                gather = time.perf_counter() - t0
                adapters = sum(p.numel() * p.element_size() for _, _, m in adapted_linears(_unwrap(trainer.model[0]))
                               for p in m.lora.parameters())
                results[label] = (statistics.median(times), *_state_bytes(trainer), sent, gather, adapters)
            finally:
                destroy_parallel()
    mib = 2 ** 20
    print(f"{'':6} {'step s':>8} {'trainable':>11} {'Adam MiB':>9} {'grads MiB':>10} {'sync MiB':>9} "
          f"{'gather s':>9} {'adapters MiB':>13}")
    for label, (step, n, state, grads, sent, gather, adapters) in results.items():
        print(f"{label:6} {step:8.3f} {n:11,d} {state / mib:9.2f} {grads / mib:10.2f} {sent / mib:9.2f} "
              f"{gather:9.3f} {adapters / mib:13.3f}")
    full, lora = results["full"], results["lora"]
    print(f"lora/full: step time {lora[0] / full[0]:.2f}x, Adam state {lora[2] / full[2]:.4f}x, "
          f"gradient buffers {lora[3] / full[3]:.4f}x, sync bytes {lora[4] / full[4]:.2f}x (merged weights; "
          f"the adapters alone would be {lora[6] / full[4]:.4f}x)")


if __name__ == "__main__":
    main()
