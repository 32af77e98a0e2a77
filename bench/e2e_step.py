"""Whole RL steps of the real train.py against its two raw halves, measured side by side in one run.

    .venv/bin/python bench/e2e_step.py [--rollouts 8] [--workloads fixed variable]

The workload (one engine, one training rank, this machine's CPUs): a random-init 20M-parameter Qwen3 (hidden 384,
6 layers, 6 heads, 2 KV heads, head_dim 64, MLP 1536, vocab 8192, untied; `vime.synthetic.tiny_model`), 16 prompts x 8
samples per rollout, prompts of exactly 32 tokens (32 digits: the tokenizer splits digits one by one),
temperature 1, micro-batch 16, global batch 128 (one optimizer step per rollout), lr 1e-5, no KL, a fixed reward
(`e2e_step_plugin.reward`, the share of even token ids in the response).
- fixed: 64 new tokens per sample (the end-of-sequence token is ignored).
- variable: responses stop at any of 200 stop token ids (`--rollout-stop-token-ids`), at most 64 tokens. The
  random model samples close to uniformly over its 8192 ids, so about 1 token in 41 stops a response: lengths run
  from 1 to 64 with a mean near 32 (the measured mean is printed). No minimum length: vLLM's `min_tokens` masks
  the stop tokens, which would make the engines sample from another policy than the one trained.

For each workload: `train.py` runs --rollouts rollouts (engines compiled, defaults otherwise) and the per-phase
medians of its metrics.jsonl are read, the first rollout (compilation, warm-up) left out. Then, with nothing else
running, the two raw pieces on the same requests and token batches:
- raw generation: vLLM's offline `LLM.generate` in a fresh process, the same 128 requests and sampling
  parameters, compiled, float32, on all of this machine's CPUs, engine core and worker in that one process
  (vLLM's fastest layout here; median of 3 after a warm-up);
- raw training: a bare torch forward + backward + fused AdamW step of the HF model on the token batches the run
  trained on (its saved rollouts), micro-batches of 16 right-padded sequences, loss on response tokens, all CPUs
  (median over the saved rollouts after a warm-up).
Printed: the phase medians, the step, and step / (raw generation + raw training); for the variable workload also
its step / the fixed workload's step. A benchmark, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
PROMPTS, SAMPLES, PROMPT_LEN, MAX_NEW = 16, 8, 32, 64
STOP_IDS = list(range(8192 - 200, 8192))
PHASES = ("rollout/time", "perf/train_time", "perf/update_weights_time", "perf/step_time")


def build_model(out: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from vime.synthetic.tiny_model import build_tiny_model

    return build_tiny_model(out, arch="qwen3", vocab_size=8192, hidden_size=384, num_layers=6, num_heads=6,
                            num_kv_heads=2, intermediate_size=1536)


def write_prompts(path: Path, count: int) -> Path:
    import random

    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": "".join(rng.choice("0123456789") for _ in range(PROMPT_LEN))}) + "\n")
    return path


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), str(REPO), os.environ.get("PYTHONPATH", "")])}


def run_vime(model: Path, data: Path, out: Path, workload: str, rollouts: int) -> list[dict]:
    cmd = [sys.executable, str(REPO / "train.py"), "--hf-checkpoint", str(model), "--prompt-data", str(data),
           "--input-key", "prompt", "--custom-rm-path", "e2e_step_plugin.reward",
           "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES),
           "--rollout-max-response-len", str(MAX_NEW), "--rollout-temperature", "1.0",
           "--micro-batch-size", "16", "--global-batch-size", str(PROMPTS * SAMPLES), "--lr", "1e-5",
           "--rollout-num-gpus", "1", "--vllm-max-model-len", "256", "--num-rollout", str(rollouts),
           "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.jsonl"), "--output-dir", str(out / "run")]
    if workload == "fixed":
        cmd += ["--custom-generate-function-path", "e2e_step_plugin.generate_fixed"]
    else:
        cmd += ["--rollout-stop-token-ids", *map(str, STOP_IDS)]
    log = out / "train.log"
    out.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env(), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"train.py failed ({proc.returncode}); see {log}")
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "perf/step_time" in r][1:]


RAW_GENERATION = textwrap.dedent('''
    import json, os, statistics, sys, time
    from vllm import LLM, SamplingParams
    model, prompts_file, workload, stop_ids = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    prompts = [json.loads(line)["prompt"] for line in open(prompts_file)][:%(prompts)d]
    llm = LLM(model=model, dtype="float32", max_model_len=256, seed=0)
    extra = dict(ignore_eos=True) if workload == "fixed" else dict(stop_token_ids=stop_ids)
    requests = [{"prompt_token_ids": llm.get_tokenizer()(p)["input_ids"]} for p in prompts for _ in range(%(samples)d)]
    params = [SamplingParams(max_tokens=%(max_new)d, temperature=1.0, logprobs=0, seed=i, **extra)
              for i in range(len(requests))]
    times, lengths = [], []
    for repeat in range(4):
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        if repeat:
            times.append(time.perf_counter() - start)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps({"seconds": statistics.median(times), "mean_length": sum(lengths) / len(lengths)}))
''') % {"prompts": PROMPTS, "samples": SAMPLES, "max_new": MAX_NEW}


def raw_generation(model: Path, data: Path, workload: str) -> dict:
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    # vLLM's fastest layout here: engine core and worker inside this process, OpenMP on every CPU
    child_env = {**env(), "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_KVCACHE_SPACE": "1",
                 "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                 "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))), "OMP_PLACES": "{%s}" % cpus,
                 "OMP_PROC_BIND": "true"}
    proc = subprocess.run([sys.executable, "-c", RAW_GENERATION, str(model), str(data), workload,
                           json.dumps(STOP_IDS)], env=child_env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"raw generation failed:\n{proc.stderr[-4000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])


def raw_training(model: Path, rollout_files: list[Path]) -> float:
    """Median seconds of a bare forward + backward + AdamW step over one rollout's samples (micro-batches of 16)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=True)

    def step(samples: list[dict]) -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for i in range(0, len(samples), 16):
            mb = samples[i:i + 16]
            longest = max(len(s["tokens"]) for s in mb)
            ids = torch.zeros(len(mb), longest, dtype=torch.long)
            labels = torch.full((len(mb), longest), -100, dtype=torch.long)
            mask = torch.zeros(len(mb), longest, dtype=torch.long)
            for row, s in enumerate(mb):
                n, r = len(s["tokens"]), s["response_length"]
                ids[row, :n] = torch.tensor(s["tokens"])
                labels[row, n - r:n] = ids[row, n - r:n]
                mask[row, :n] = 1
            loss = hf(input_ids=ids, attention_mask=mask, labels=labels).loss * len(mb) / len(samples)
            loss.backward()
        opt.step()
        return time.perf_counter() - start

    rollouts = [[json.loads(line) for line in f.read_text().splitlines()] for f in rollout_files]
    step(rollouts[0])  # warm-up
    return statistics.median(step(r) for r in rollouts[1:])


def median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=8, help="train.py rollouts per workload (default: 8).")
    p.add_argument("--workloads", nargs="+", default=["fixed", "variable"], choices=["fixed", "variable"])
    p.add_argument("--work-dir", default=None, help="Where models and runs go (default: a new temp dir).")
    a = p.parse_args()
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="vime_e2e_step_"))
    model = work / "model"
    if not (model / "config.json").is_file():
        build_model(model)
    data = write_prompts(work / "prompts.jsonl", 4096)
    results = {}
    for workload in a.workloads:
        out = work / workload
        records = run_vime(model, data, out, workload, a.rollouts)
        saved = sorted(out.glob("rollout_*.jsonl"), key=lambda f: int(f.stem.split("_")[1]))[1:]
        results[workload] = {
            "phases": {k: median(records, k) for k in PHASES},
            "response_len": median(records, "rollout/response_len_mean"),
            "raw_generation": raw_generation(model, data, workload),
            "raw_training": raw_training(model, saved),
            "gap": median(records, "train_rollout_logprob_abs_diff"),
        }
    for workload, r in results.items():
        step = r["phases"]["perf/step_time"]
        raw = r["raw_generation"]["seconds"] + r["raw_training"]
        print(f"\n== {workload} (mean response length: vime {r['response_len']:.1f}, "
              f"raw {r['raw_generation']['mean_length']:.1f} tokens)")
        for key, value in r["phases"].items():
            print(f"  vime {key:<26}{value:8.2f} s")
        print(f"  raw generation (vLLM offline)   {r['raw_generation']['seconds']:8.2f} s")
        print(f"  raw training (torch f+b+AdamW)  {r['raw_training']:8.2f} s")
        print(f"  step / (raw generation + raw training) = {step:.2f} / {raw:.2f} = {step / raw:.3f}  (target <= 1.0)")
        print(f"  train/rollout log-prob gap (median) {r['gap']:.2e}")
    if {"fixed", "variable"} <= results.keys():
        ratio = results["variable"]["phases"]["perf/step_time"] / results["fixed"]["phases"]["perf/step_time"]
        print(f"\nvariable step / fixed step = {ratio:.3f}  (target <= 0.85)")
    print(f"\nruns and logs in {work}")


if __name__ == "__main__":
    main()
