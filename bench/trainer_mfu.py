"""Trainer throughput on one device: whole GRPO steps of vime's `MegatronTrainer.train` (the old-log-prob forward,
the loss, backward and the optimizer step), in tokens/s and MFU, for the shapes issue 36 names:

    python bench/trainer_mfu.py [--shapes qwen3-0.6b-1k,qwen3-0.6b-4k,218m] [--json OUT] [--steps 3]

- qwen3-0.6b-1k / -4k: hidden 1024, 28 layers, 16 heads, 8 KV heads, MLP 3072, vocab 151,936; 16 prompts x 8
  samples of 1k (256 + 768) or 4k (1024 + 3072) tokens, bf16;
- qwen3-1.7b-4k: Qwen3-1.7B as published (hidden 2048, MLP 6144, otherwise as 0.6B), 4k tokens a sample;
- 218m: the same as 0.6B but 16 layers and vocab 8192, 256 + 768 tokens (the shape measured in ../shared/GPU.md);
- tiny: 2 layers of 128, for a smoke run on CPU (float32).
Each shape runs with shared prompts off and on (`--share-group-prompts`), side by side in one process.

MFU = counted FLOPs / seconds / peak (--peak-tflops, default 989, an H100 / H200 SXM dense bf16). The FLOPs are
`vime.trainer.flops`'s count of what the step runs (checked against torch's FlopCounterMode in tests/unit/test_flops.py):
the passes that run (no old-log-prob forward with one step a rollout and no KL), the output layer over response rows
only, a shared prompt once, attention as its kernels are called; `mfu` uses the useful part (no padding, causal
attention's lower triangle), `mfu_executed` all of it. The raw limit printed next to it: a matmul of the model's
widest shape on the same device. Each row is written to --json as it finishes; an out-of-memory row says so and the
next one runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # Qwen3-0.6B as published: head_dim 128 (16 x 128 = 2048 > hidden), tied embeddings
    "qwen3-0.6b-1k": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, mlp=3072, vocab=151936,
                          prompt=256, response=768, tied=True),
    "qwen3-0.6b-4k": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, mlp=3072, vocab=151936,
                          prompt=1024, response=3072, tied=True),
    "qwen3-1.7b-4k": dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, mlp=6144, vocab=151936,
                          prompt=1024, response=3072, tied=True),  # the target: >= 35% MFU on one H100
    "218m": dict(hidden=1024, layers=16, heads=16, kv_heads=8, mlp=3072, vocab=8192, prompt=256, response=768),
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, mlp=256, vocab=512, prompt=16, response=48),
}


def build_checkpoint(s: dict, out: Path) -> Path:
    from vime.synthetic.tiny_model import build_tiny_model

    return build_tiny_model(out, arch="qwen3", seed=0, vocab_size=s["vocab"], hidden_size=s["hidden"],
                            num_layers=s["layers"], num_heads=s["heads"], num_kv_heads=s["kv_heads"],
                            intermediate_size=s["mlp"], max_position_embeddings=s["prompt"] + s["response"] + 64,
                            tie_word_embeddings=s.get("tied", False),
                            config={"head_dim": s["head_dim"]} if "head_dim" in s else None)


def rollout(s: dict, prompts: int, group: int, seed: int = 0) -> list[list[dict]]:
    from vime.data.sample import Sample

    g = torch.Generator().manual_seed(seed)
    groups = []
    for p in range(prompts):
        prompt = torch.randint(5, s["vocab"] - 1, (s["prompt"],), generator=g).tolist()
        groups.append([Sample(group_index=p, index=p * group + k,
                              tokens=prompt + torch.randint(5, s["vocab"] - 1, (s["response"],), generator=g).tolist(),
                              response_length=s["response"], reward=float(k % 2), rollout_log_probs=None,
                              status=Sample.Status.COMPLETED).to_dict() for k in range(group)])
    return groups


def raw_matmul_tflops(s: dict, dtype: torch.dtype, device: str) -> float:
    """What the device does on a plain matmul of the MLP's shape (tokens x hidden x mlp)."""
    a = torch.randn(8192, s["hidden"], dtype=dtype, device=device)
    b = torch.randn(s["hidden"], s["mlp"], dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    start, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    sync(device)
    return 2 * 8192 * s["hidden"] * s["mlp"] * n / (time.perf_counter() - start) / 1e12


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(shape: str, ckpt: Path, share: bool, steps: int, micro_batch: int, prompts: int, group: int,
            peak: float) -> dict:
    from vime.arguments import parse_args
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.flops import trainer_rollout_flops
    from vime.trainer.trainer import MegatronTrainer

    s = SHAPES[shape]
    gpu = torch.cuda.is_available()
    args = parse_args(trainer_argv(s, ckpt, share, micro_batch, prompts, group, gpu))
    plan = planned(args, gpu)
    trainer = MegatronTrainer(args)  # one per measurement: Megatron's groups and memory start fresh
    try:
        data = rollout(s, prompts, group)
        trainer.train(0, data)  # warm-up: kernels chosen, memory pools grown
        flops = trainer_rollout_flops(trainer, data)  # the passes it ran, over its micro-batches
        sync("cuda" if gpu else "cpu")
        times = []
        for step in range(steps):
            start = time.perf_counter()
            trainer.train(step + 1, data)
            sync("cuda" if gpu else "cpu")
            times.append(time.perf_counter() - start)
    finally:
        del trainer
        destroy_parallel()
        if gpu:
            torch.cuda.empty_cache()
    best = min(times)
    samples = prompts * group
    tokens = samples * (s["prompt"] + s["response"])
    row = {"shape": shape, "shared_prompts": share, "micro_batch": micro_batch, "step_s": round(best, 4),
           "tokens_per_s": round(tokens / best), "tflops": round(flops["useful"] / best / 1e12, 2),
           "mfu": round(flops["useful"] / best / (peak * 1e12), 4),
           "mfu_executed": round(flops["total"] / best / (peak * 1e12), 4),
           "gflop_per_token": round(flops["useful"] / tokens / 1e9, 3),
           "device": torch.cuda.get_device_name(0) if gpu else "cpu"}
    row.update(plan)
    if gpu:
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["planned_over_measured"] = round(row["planned_allocated_gib"] / row["peak_memory_gib"], 3)
        torch.cuda.reset_peak_memory_stats()
    return row


def trainer_argv(s: dict, ckpt: Path, share: bool, micro_batch: int, prompts: int, group: int, gpu: bool) -> list:
    return ["--hf-checkpoint", str(ckpt), "--debug-train-only", "--load-debug-rollout-data",
            "unused_{rollout_id}.jsonl", "--rm-type", "math", "--rollout-batch-size", str(prompts),
            "--n-samples-per-prompt", str(group), "--micro-batch-size", str(micro_batch), "--lr", "1e-6",
            "--num-steps-per-rollout", "1", "--share-group-prompts" if share else "--no-share-group-prompts",
            "--rollout-max-prompt-len", str(s["prompt"]), "--rollout-max-response-len", str(s["response"]),
            *(["--bf16", "--use-distributed-optimizer"] if gpu else [])]


def fitting_micro_batch(s: dict, ckpt: Path, share: bool, prompts: int, group: int) -> int:
    """The largest micro-batch of 8, 4, 2, 1 samples the memory planner says fits this device (1 if none)."""
    from vime.arguments import parse_args

    gpu = torch.cuda.is_available()
    for size in (8, 4, 2):
        if planned(parse_args(trainer_argv(s, ckpt, share, size, prompts, group, gpu)), gpu)["planned_fits"]:
            return size
    return 1


def planned(args, gpu: bool) -> dict:
    """The memory planner's prediction for this trainer (`python -m vime.plan`): its peak, and that peak less the
    CUDA context and allocator slack, which torch's max_memory_allocated does not see."""
    from vime.plan.run_plan import plan_run

    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpu else 24.0
    trainer = plan_run(args, memory, device="cuda" if gpu else "cpu").roles["trainer"]
    return {"planned_peak_gib": trainer["peak_gib"],
            "planned_allocated_gib": round(trainer["peak_gib"] - trainer["parts_gib"].get("runtime", 0.0), 2),
            "planned_fits": trainer["fits"]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-1.7b-4k,qwen3-0.6b-1k,qwen3-0.6b-4k,218m")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch-size", default="auto",
                   help="samples a micro-batch, or auto: the largest of 8, 4, 2, 1 the memory planner fits")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--json", default=None, help="Write the rows here as JSON too.")
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from conftest import allow_parsing_without_vllm  # a GPU machine may have no vLLM: its flags are then empty

    allow_parsing_without_vllm()
    rows = []
    for shape in a.shapes.split(","):
        if shape not in SHAPES:
            p.error(f"--shapes: unknown {shape!r}; one of {sorted(SHAPES)}")
        s = SHAPES[shape]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        raw = raw_matmul_tflops(s, torch.bfloat16 if device == "cuda" else torch.float32, device)
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = build_checkpoint(s, Path(tmp) / "model")
            for share in (False, True):
                micro_batch = fitting_micro_batch(s, ckpt, share, a.prompts, a.group) \
                    if a.micro_batch_size == "auto" else int(a.micro_batch_size)
                try:
                    row = measure(shape, ckpt, share, a.steps, micro_batch, a.prompts, a.group, a.peak_tflops)
                except torch.OutOfMemoryError as e:  # a row of its own; the next shape still runs
                    row = {"shape": shape, "shared_prompts": share, "micro_batch": micro_batch,
                           "error": f"out of memory: {str(e).splitlines()[0]}"}
                    torch.cuda.empty_cache()
                row["raw_matmul_tflops"] = round(raw, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if a.json:  # as each row finishes: a later crash or timeout loses nothing measured
                    Path(a.json).write_text(json.dumps(rows, indent=2))
        off, on = rows[-2], rows[-1]
        if "error" not in off and "error" not in on:
            print(f"{shape}: {off['tokens_per_s']} tok/s, MFU {off['mfu']:.1%} without shared prompts; shared / not: "
                  f"{off['step_s'] / on['step_s']:.2f}x the speed; matmul limit {raw:.0f} TFLOP/s "
                  f"({raw / a.peak_tflops:.0%} of peak)", flush=True)
    return rows


if __name__ == "__main__":
    main()
