"""slime's own launch scripts through vime's train.py, their flag sets as slime ships them (THUDM/slime
scripts/run-qwen3-4B.sh with scripts/models/qwen3-4B.sh, and scripts/run-qwen3-30B-A3B.sh with
scripts/models/qwen3-30B-A3B.sh: every array of each), on the real stack: vLLM engines behind vllm-router, Megatron-core
on gloo, Ray, two rollouts each.

What was made small for this CPU, and nothing else (`SMALL`): paths; the model's sizes (MODEL_ARGS carry the tiny
model's numbers, in the same flags); batch and length sizes; GPU counts (8 -> 2 per node, 2 GPUs an engine -> 1);
--num-rollout and --eval-interval. vime's own additions (`VIME_ONLY`): --output-dir, so that each run writes where the
test reads. Every other flag, --sglang-* and --colocate included, is the script's.

- Dense (qwen3-4B): --ref-load is a converted torch_dist checkpoint of *another* model than the one --load resumes
  from, so the KL at the first step is not zero: it equals a float32 transformers computation of low_var_kl between
  the two models on the rollout's tokens. This run also adds --ref-update-interval 1 (the one flag added beyond the
  script): after rollout 0 the reference becomes the actor, so rollout 1's KL is ~0 where it would otherwise be the
  same order as rollout 0's.
- MoE (qwen3-30B-A3B): --load is empty, as in the script, so the actor starts from --ref-load, a converted checkpoint
  of another model than --hf-checkpoint: the engines generate rollout 0 with the reference's weights (its log-probs
  match the reference model's, not --hf-checkpoint's), and the KL at the first step is exactly 0.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.processes import stack_pids
from tests.helpers.hf_reference import load_hf, response_log_probs
from vime.rollout.debug_data import read_compact_rollout
from vime.synthetic.tiny_model import build_tiny_model

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
TEMPERATURE_4B = 0.8  # the 4B script's --rollout-temperature (the MoE script's is 1)


def _model_args_4b(config: dict) -> list[str]:
    """scripts/models/qwen3-4B.sh, the tiny model's numbers in the same flags."""
    return ["--swiglu", "--num-layers", str(config["num_hidden_layers"]), "--hidden-size", str(config["hidden_size"]),
            "--ffn-hidden-size", str(config["intermediate_size"]), "--num-attention-heads",
            str(config["num_attention_heads"]), "--group-query-attention", "--num-query-groups",
            str(config["num_key_value_heads"]), "--use-rotary-position-embeddings", "--disable-bias-linear",
            "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base",
            str(int(config["rope_parameters"]["rope_theta"])), "--vocab-size", str(config["vocab_size"]),
            "--kv-channels", str(config["head_dim"]), "--qk-layernorm"]


def _model_args_30b(config: dict) -> list[str]:
    """scripts/models/qwen3-30B-A3B.sh (FIRST_K_DENSE_REPLACE=0: every layer MoE), the tiny model's numbers."""
    layers = config["num_hidden_layers"]
    return ["--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads",
            str(config["num_attention_heads"]), "--num-query-groups", str(config["num_key_value_heads"]),
            "--kv-channels", str(config["head_dim"]), "--num-layers", str(layers), "--hidden-size",
            str(config["hidden_size"]), "--ffn-hidden-size", str(config["intermediate_size"]),
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--norm-epsilon", "1e-6",
            "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size",
            str(config["vocab_size"]), "--rotary-base", str(int(config["rope_parameters"]["rope_theta"])),
            "--moe-ffn-hidden-size", str(config["moe_intermediate_size"]), "--moe-router-score-function", "softmax",
            "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", str(config["num_experts_per_tok"]),
            "--moe-layer-freq", "[" + ", ".join(["1"] * layers) + "]", "--num-experts",
            str(config["num_local_experts"]), "--moe-grouped-gemm", "--moe-token-drop-policy", "probs",
            "--moe-router-dtype", "fp32", "--moe-permute-fusion", "--moe-aux-loss-coeff", "0"]


def _script_args(hf: Path, ref_load: Path, load_save: Path, data: tuple[Path, Path], temperature: str,
                 eval_top_p: str, optimizer_extra: list[str], sglang_extra: list[str]) -> list[str]:
    """The CKPT, ROLLOUT, EVAL, PERF, GRPO, OPTIMIZER, SGLANG and MISC arrays and the launch line of slime's
    run-qwen3-*.sh; SMALL values where the script names paths, sizes or GPU counts."""
    return [
        # launch line: --actor-num-nodes 1 --actor-num-gpus-per-node 8 (SMALL: 2) --colocate
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--colocate",
        # CKPT_ARGS
        "--hf-checkpoint", str(hf), "--ref-load", str(ref_load), "--load", str(load_save), "--save", str(load_save),
        "--save-interval", "20",
        # ROLLOUT_ARGS (SMALL: --num-rollout 3000 -> 2, --rollout-batch-size 32 -> 4, --n-samples-per-prompt 8 -> 4,
        # --rollout-max-response-len 8192 -> 16, --global-batch-size 256 -> 16: one step a rollout, as there)
        "--prompt-data", str(data[0]), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "2", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16", "--rollout-temperature", temperature,
        "--global-batch-size", "16", "--balance-data",
        # EVAL_ARGS (SMALL: --eval-interval 20 -> 20 of 2 rollouts: the final eval only, --n-samples-per-eval-prompt
        # 16 -> 2, --eval-max-response-len 16384 -> 16)
        "--eval-interval", "20", "--eval-prompt-data", "aime", str(data[1]), "--n-samples-per-eval-prompt", "2",
        "--eval-max-response-len", "16", "--eval-top-p", eval_top_p,
        # PERF_ARGS (the 30B script's TP 4 / EP 8 -> 2 / 2 on two ranks)
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", "1", "--expert-model-parallel-size", "2" if sglang_extra else "1",
        "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
        # GRPO_ARGS
        "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
        "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        # OPTIMIZER_ARGS
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98", *optimizer_extra,
        # SGLANG_ARGS (SMALL: --rollout-num-gpus-per-engine 2 / 8 -> 1)
        "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7", *sglang_extra,
        # MISC_ARGS
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
        "--attention-softmax-in-fp32", "--attention-backend", "flash",
    ]


def _convert(hf: Path, out: Path) -> Path:
    """The convert script's command line (in a process forked with Megatron imported: `warm_start`)."""
    from tests.helpers import warm_start

    log = out.with_name(out.name + ".log")
    status = warm_start.run_script(REPO / "scripts" / "convert_hf_to_torch_dist.py",
                                   ["--hf-checkpoint", str(hf), "--save", str(out)], log, dict(os.environ), REPO, 300)
    assert status == 0, log.read_text()[-3000:]
    return out


def _train(argv: list[str], out: Path) -> tuple[list[dict], str]:
    assert not stack_pids(), "engine or router processes are already running"
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *argv, "--output-dir", str(out)],  # VIME_ONLY
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    assert not stack_pids(), f"processes left after the run: {stack_pids()}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "train/steps" in r], proc.stderr


def _trained_kl(samples: list[dict], actor, ref, temperature: float) -> float:
    """low_var_kl(actor || ref) averaged over every trained token of the rollout (token_mean), in float32."""
    total, count = 0.0, 0
    for s in samples:
        if s["status"] not in ("completed", "truncated") or s.get("reward") is None:
            continue
        prompt_length = len(s["tokens"]) - s["response_length"]
        lp = response_log_probs(actor, s["tokens"], prompt_length, temperature).double()
        ref_lp = response_log_probs(ref, s["tokens"], prompt_length, temperature).double()
        log_ratio = (lp - ref_lp).clamp(-20, 20)
        kl = (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10, 10)
        mask = torch.tensor(s.get("loss_mask") or [1] * s["response_length"], dtype=torch.float64)
        total += float((kl * mask).sum())
        count += int(mask.sum())
    return total / count


def test_slime_qwen3_4b_script_with_a_reference_other_than_the_actor(arithmetic_data, tmp_path):
    actor_hf = build_tiny_model(tmp_path / "actor", arch="qwen3", seed=0, tie_word_embeddings=True)  # as Qwen3-4B
    ref_hf = build_tiny_model(tmp_path / "ref", arch="qwen3", seed=1, tie_word_embeddings=True)
    config = json.loads((actor_hf / "config.json").read_text())
    ref_load = _convert(ref_hf, tmp_path / "ref_torch_dist")
    load_save = _convert(actor_hf, tmp_path / "qwen3_slime")  # --load resumes the actor's own weights
    out = tmp_path / "run"
    argv = [*_model_args_4b(config), *_script_args(actor_hf, ref_load, load_save, arithmetic_data,
                                                   str(TEMPERATURE_4B), "0.7", [], []),
            "--ref-update-interval", "1"]  # the one flag beyond the script (module docstring)
    records, stderr = _train(argv, out)
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert "--sglang-mem-fraction-static 0.7 -> --vllm-gpu-memory-utilization 0.7" in stderr
    samples = read_compact_rollout(out / "rollouts" / "rollout_0.jsonl.gz")
    expected = _trained_kl(samples, load_hf(actor_hf), load_hf(ref_hf), TEMPERATURE_4B)
    assert expected > 1e-3  # two random models: far from zero
    assert records[0]["train/kl_loss"] == pytest.approx(expected, rel=1e-4), (records[0]["train/kl_loss"], expected)
    assert records[0]["train/ref_updated"] == 1.0
    # the reference is the actor after rollout 0: a step of lr 1e-6 away, where --ref-load was `expected` away
    assert records[1]["train/kl_loss"] < expected * 1e-3, records[1]["train/kl_loss"]
    assert records[1]["train_rollout_logprob_abs_diff"] < 1e-4  # the engines serve the trained actor
    assert (load_save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"  # saved at the end


def test_slime_qwen3_30b_a3b_script_starts_the_actor_from_ref_load(arithmetic_data, tmp_path):
    layout = {"mlp_only_layers": []}  # every layer MoE, as the script's --moe-layer-freq
    hf = build_tiny_model(tmp_path / "hf", arch="qwen3_moe", seed=0, config=layout)
    ref_hf = build_tiny_model(tmp_path / "ref", arch="qwen3_moe", seed=1, config=layout)
    config = json.loads((hf / "config.json").read_text())
    ref_load = _convert(ref_hf, tmp_path / "ref_torch_dist")
    out = tmp_path / "run"
    argv = [*_model_args_30b(config), *_script_args(
        hf, ref_load, tmp_path / "qwen3_moe_slime", arithmetic_data, "1", "1",
        ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"],
        ["--sglang-cuda-graph-bs", "1", "2", "4", "8", *map(str, range(16, 257, 8))])]
    records, stderr = _train(argv, out)
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert "the actor starts from --ref-load" in stderr
    assert records[0]["train/kl_loss"] == 0.0  # the actor is the reference
    samples = read_compact_rollout(out / "rollouts" / "rollout_0.jsonl.gz")
    ref_model, hf_model = load_hf(ref_hf), load_hf(hf)
    gaps = {"ref": [], "hf": []}
    for s in samples:
        prompt_length = len(s["tokens"]) - s["response_length"]
        engine = torch.tensor(s["rollout_log_probs"], dtype=torch.float64)
        for name, model in (("ref", ref_model), ("hf", hf_model)):
            gaps[name].append(float((response_log_probs(model, s["tokens"], prompt_length).double() - engine)
                                    .abs().max()))
    # rollout 0 was generated with --ref-load's weights, pushed into the engines at the start
    assert max(gaps["ref"]) < 1e-3 and min(gaps["hf"]) > 10 * max(gaps["ref"]), gaps
    assert math.isfinite(records[1]["train/kl_loss"])
