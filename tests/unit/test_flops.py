"""The FLOP model (`vime.trainer.flops`) against torch's own count: `torch.utils.flop_counter.FlopCounterMode`
around whole `MegatronTrainer.train` calls of vime's trainer (Megatron-core on gloo, this CPU), for dense and MoE
models, shared prompts on and off, one optimizer step or two (the old-log-prob pass) with a KL reference (its pass),
within 3%. torch's counter has no formula for the CPU flash-attention kernel: the test gives it one from the shapes
the kernel is called with (what the model must predict), as torch counts its CUDA kernels."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig

from vime.arguments import parse_args
from vime.synthetic.tiny_model import build_tiny_model
from vime.trainer.batching import micro_batch_inputs
from vime.trainer.megatron.parallel import destroy_parallel
from vime.trainer.flops import (FlopShape, flop_metrics, micro_batch_work, pass_flops, peak_tflops,
                                rollout_flops, trainer_rollout_flops)
from vime.data.sample import Sample
from vime.trainer.train_batch import TrainBatch

aten = torch.ops.aten


def _sdpa(q, k, v, *args, out_shape=None, **kwargs) -> int:
    """What a [b, heads, q, d] x [b, kv heads, k, d] attention call computes: Q K^T and P V (torch's formula,
    query heads)."""
    b, heads, queries, d = q
    return 4 * b * heads * queries * k[2] * d


def _sdpa_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return int(2.5 * _sdpa(q, k, v))


CPU_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward}


def _rollout(prompts: int = 2, group: int = 4, prompt_len: int = 16) -> list[list[dict]]:
    g = torch.Generator().manual_seed(0)
    groups = []
    for p in range(prompts):
        prompt = torch.randint(5, 500, (prompt_len,), generator=g).tolist()
        groups.append([Sample(group_index=p, index=p * group + k, response_length=20 + 7 * k,
                              tokens=prompt + torch.randint(5, 500, (20 + 7 * k,), generator=g).tolist(),
                              reward=float(k % 2), status=Sample.Status.COMPLETED).to_dict() for k in range(group)])
    return groups


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("flops")
    return {"qwen3": build_tiny_model(root / "dense", arch="qwen3", seed=0),
            "qwen3_moe": build_tiny_model(root / "moe", arch="qwen3_moe", seed=0, config={"mlp_only_layers": []}),
            # Gated DeltaNet layers and gated attention (a dense MLP: the routed experts are Qwen3-MoE's case)
            "qwen3_next": build_tiny_model(root / "next", arch="qwen3_next", seed=0, config={"num_experts": 0})}


@pytest.mark.parametrize("arch,share,steps,kl", [
    ("qwen3", False, 1, False), ("qwen3", True, 1, False), ("qwen3_moe", False, 1, False),
    ("qwen3_next", False, 1, False),
    ("qwen3", True, 2, True),  # the old-log-prob pass (two steps) and the reference's (KL loss)
])
def test_counted_flops_match_torchs_count_of_the_training_step(checkpoints, arch, share, steps, kl):
    from vime.trainer.trainer import MegatronTrainer

    ckpt = checkpoints[arch]
    argv = ["--hf-checkpoint", str(ckpt), "--debug-train-only", "--load-debug-rollout-data", "unused_{rollout_id}.jsonl",
            "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--micro-batch-size",
            "2", "--lr", "1e-6", "--num-steps-per-rollout", str(steps),
            "--share-group-prompts" if share else "--no-share-group-prompts",
            *(["--use-kl-loss", "--kl-loss-coef", "0.01"] if kl else [])]
    trainer = MegatronTrainer(parse_args(argv))
    try:
        data = _rollout()
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
            trainer.train(0, data)
        model = trainer_rollout_flops(trainer, data)  # what the run's perf/* metrics count
        assert trainer.forward_passes == int(steps > 1) + int(kl)  # the old log-probs, the reference's
        batch = TrainBatch.from_samples(data, trainer.args)
        by_hand = rollout_flops(FlopShape.from_hf(AutoConfig.from_pretrained(ckpt)), [
            [micro_batch_work(micro_batch_inputs([batch.tokens[i] for i in mb], [batch.response_lengths[i] for i in mb],
                                                 packed=True, share_prompts=share), [len(batch.tokens[i]) for i in mb])
             for mb in mbs] for _, _, mbs in trainer._split(batch)], int(steps > 1) + int(kl))
        metrics = flop_metrics(trainer, data, seconds=2.0)
    finally:
        del trainer
        destroy_parallel()
    counted = counter.get_total_flops()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    if "aten.convolution_backward" in by_op:  # torch's counter takes Gated DeltaNet's depthwise convolution's
        # backward for a dense one (it does not divide by the groups): it is two of its forward
        counted += 2 * by_op["aten.convolution"] - by_op["aten.convolution_backward"]
    assert model == by_hand
    assert metrics["perf/train_tflop"] == pytest.approx(model["useful"] / 1e12)
    assert metrics["perf/train_tflops_per_s"] == pytest.approx(model["useful"] / 2e12) and "perf/mfu" not in metrics
    # Gated DeltaNet: autograd skips some state products of one-chunk rows, which these short samples all are
    # (`FlopShape.linear_attention_flops`): 3.5% of this step's total
    assert model["total"] == pytest.approx(counted, rel=0.05 if arch == "qwen3_next" else 0.03), (
        model, counter.get_flop_counts()["Global"])
    assert model["useful"] < model["total"]  # causal attention's upper triangle is not work


def test_shared_prompts_count_the_prompt_once_and_the_logits_only_for_responses():
    shape = FlopShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=1000)
    prompt = list(range(5, 37))  # 32 tokens, shared by 4 samples of 8-token responses
    tokens = [prompt + [100 + k] * 8 for k in range(4)]
    plain = micro_batch_work(micro_batch_inputs(tokens, [8] * 4, packed=True), [40] * 4)
    shared = micro_batch_work(micro_batch_inputs(tokens, [8] * 4, packed=True, share_prompts=True), [40] * 4)
    assert (plain.rows, shared.rows) == (160, 32 + 4 * 8) and plain.logit_rows == shared.logit_rows == 32
    assert shared.attention == ((1, 32, 32), (4, 8, 40))  # the prompt alone, then each response after it
    forward = pass_flops(shape, [plain], train=False)
    base, _ = shape.layer_flops_per_token()
    assert forward["matmul"] == base * 160 and forward["logits"] == 2 * 64 * 1000 * 32
    assert forward["attention"] == 4 * 4 * 16 * 40 * 40 * 4 * 2  # 4 sequences, 4 heads of 16, 2 layers
    train = pass_flops(shape, [plain], train=True)
    assert train["matmul"] == 3 * forward["matmul"] and train["attention"] == 3.5 * forward["attention"]
    lora = pass_flops(FlopShape(**{**shape.__dict__, "lora_rank": 8}), [plain], train=True)
    assert lora["matmul"] < train["matmul"]  # a frozen base computes no weight gradients; the adapters are small


def test_mfu_peaks_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and peak_tflops("Some GPU") is None
