"""LoRA against full fine-tuning on the same model, side by side in one process: seconds per GRPO step
(`MegatronTrainer.train`), trainable parameters, optimizer state and gradient buffer bytes, and one weight update
into a running vLLM engine as the run does it (`update_once`: pause -> send -> load -> resume): full fine-tuning
through the disk transport (HF safetensors of the whole model), LoRA through its adapter sync (a PEFT adapter the
engine serves with vLLM's LoRA support), with the bytes each writes and the adapters' own size.

    .venv/bin/python bench/lora.py [--rank 8 --samples 32 --tokens 128 --repeats 3 --threads 2]

The model is weight_sync.py's 20M one (qwen3, hidden 512, 5 layers). Each mode gets its own engine (float32,
eager; LoRA enabled for the LoRA one), booting while its trainer builds; one warm-up step and one warm-up update,
then the median over repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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


def bench_mode(label: str, argv: list[str], groups, work: Path, repeats: int) -> dict:
    from bench.weight_sync import update_once
    from vime.arguments import parse_args
    from vime.trainer.megatron.hf_checkpoint import _unwrap
    from vime.trainer.megatron.lora import adapted_linears
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer
    from vime.engine.control.engine import VLLMEngine
    from vime.transport.weights import make_driver, make_sender
    from vime.transport.weights.base import DriverSetup
    from vime.config.train import LoraConfig, WeightSyncConfig
    from vime.driver.weight_sync import sync_kind
    from vime.utils.auth import RunToken

    args = parse_args(argv + ["--output-dir", str(work / label)])
    token = RunToken.new()
    engine = VLLMEngine(args, 0, str(work), token)
    with ThreadPoolExecutor(1) as pool:
        booting = pool.submit(engine.start)
        try:
            trainer = MegatronTrainer(args)
            trainer.train(0, groups)  # warm-up: allocations, Adam state
            steps = []
            for r in range(repeats):
                t0 = time.perf_counter()
                trainer.train(r + 1, groups)
                steps.append(time.perf_counter() - t0)
            url = booting.result()
            kind = sync_kind(WeightSyncConfig.of(args), LoraConfig.of(args))
            driver, sender = make_driver(kind, DriverSetup.of(args)), make_sender(kind)
            updates = [update_once(driver, sender, trainer, url, token, version)
                       for version in range(1, repeats + 2)][1:]
            adapters = sum(p.numel() * p.element_size() for _, _, m in adapted_linears(_unwrap(trainer.model[0]))
                           for p in m.lora.parameters())
            model_bytes = sum(t.numel() * t.element_size() for _, t in trainer.hf_weights())
            return {"step": statistics.median(steps), "state": _state_bytes(trainer), "kind": kind,
                    "update": statistics.median(u["update"] for u in updates),
                    "load": statistics.median(u["load"] for u in updates), "sent": updates[-1]["bytes"],
                    "adapters": adapters, "model": model_bytes}
        finally:
            destroy_parallel()
            try:
                booting.result()
            except Exception:
                pass
            engine.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from vime.synthetic.tiny_model import build_tiny_model

    groups = make_groups(a.samples, 4, a.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf = build_tiny_model(work / "model", arch="qwen3", seed=0, hidden_size=512, num_layers=5, num_heads=8,
                              num_kv_heads=4, intermediate_size=2048)
        base = ["--hf-checkpoint", str(hf), "--debug-train-only", "--load-debug-rollout-data",
                "unused_{rollout_id}.jsonl", "--rm-type", "math", "--rollout-batch-size", str(a.samples // 4),
                "--n-samples-per-prompt", "4", "--micro-batch-size", "8", "--train-num-threads", str(a.threads),
                "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "256"]
        results = {label: bench_mode(label, base + extra, groups, work, a.repeats)
                   for label, extra in (("full", []), ("lora", ["--lora-rank", str(a.rank)]))}
    mib = 2 ** 20
    print(f"{'':6} {'step s':>8} {'trainable':>11} {'Adam MiB':>9} {'grads MiB':>10} {'sync':>13} {'sent MiB':>9} "
          f"{'update ms':>10} {'load ms':>8} {'adapters MiB':>13}")
    for label, r in results.items():
        n, state, grads = r["state"]
        print(f"{label:6} {r['step']:8.3f} {n:11,d} {state / mib:9.2f} {grads / mib:10.2f} {r['kind']:>13} "
              f"{r['sent'] / mib:9.3f} {r['update'] * 1e3:10.1f} {r['load'] * 1e3:8.1f} {r['adapters'] / mib:13.3f}")
    full, lora = results["full"], results["lora"]
    ratio = {k: lora["state"][i] / full["state"][i] for i, k in ((1, "adam"), (2, "grads"))}
    print(f"lora/full: step time {lora['step'] / full['step']:.2f}x, Adam state {ratio['adam']:.4f}x, "
          f"gradient buffers {ratio['grads']:.4f}x, sync bytes {lora['sent'] / full['sent']:.4f}x, "
          f"sync time {lora['update'] / full['update']:.2f}x; LoRA sends {lora['sent'] / lora['adapters']:.4f}x "
          f"its adapters' bytes (target <= 1.01x)")


if __name__ == "__main__":
    main()
