"""Every trainer path of issue 36 on one CUDA GPU, with torch and megatron-core alone (skipped without a GPU):
each policy-loss variant, the PPO critic in fp32 / fp32 + distributed optimizer / bf16 + distributed optimizer,
single and multi-LoRA, on-policy distillation in both modes, a tiny MoE with routing replay and the aux loss,
shared prompts on and off, bshd and dynamic batch size, activation recompute, offload with the reference and the
teacher, resuming on the GPU from a checkpoint a CPU run saved, and the step metrics' reduction over an NCCL group
with data parallel forced to 2.

The CPU tests catch the device mix-ups these paths had (tests/unit/test_device_placement.py); here they run for
real: every step trains (no skipped step, finite loss, a gradient) and the tensors it touches are on the GPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
if torch.cuda.is_available():  # without a GPU every test skips: Megatron need not be imported to say so
    pytest.importorskip("megatron.core")

from tests.helpers.rollouts import flat, make_rollout  # noqa: E402
from tests.helpers.trainer_runs import BASE_ARGV  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"fp32": (), "fp32-distopt": ("--use-distributed-optimizer",),
           "bf16-distopt": ("--bf16", "--use-distributed-optimizer")}


def _tolerance(kind: str, dtype) -> float:
    from vime.utils.tolerances import tolerance

    return tolerance(kind, dtype, "cuda")


@contextlib.contextmanager
def gpu_trainer(hf_dir, *argv, role: str = "actor", **values):
    """A one-process MegatronTrainer on this GPU with BASE_ARGV + argv, `values` set on the parsed args."""
    from vime.arguments import parse_args
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer
    from vime.utils.misc import with_values

    args = parse_args(["--hf-checkpoint", str(hf_dir), *BASE_ARGV, *argv])
    try:
        yield MegatronTrainer(with_values(args, **values) if values else args, role=role)
    finally:
        destroy_parallel()


def with_rollout_log_probs(t, groups):
    """The groups with the engine's log-probs (what TIS / MIS / OPD's reverse KL read) as the trainer's own
    before the step: a rollout policy equal to the trained one, as a run's first step has it."""
    for s in flat(groups):
        s["rollout_log_probs"] = t.probe_log_probs(s["tokens"], s["response_length"])
    return groups


def assert_trained(metrics: dict, prefix: str = "train") -> None:
    assert metrics[f"{prefix}/skipped_steps"] == 0, metrics
    assert math.isfinite(metrics[f"{prefix}/grad_norm"]) and metrics[f"{prefix}/grad_norm"] > 0, metrics
    assert all(math.isfinite(v) for k, v in metrics.items() if isinstance(v, float)), metrics


def assert_on_gpu(t) -> None:
    assert t.device.type == "cuda"
    assert all(p.device == t.device for m in t.model for p in m.parameters())


def adam_steps_with_their_parameters(t) -> None:
    """torch's fused Adam reads `step` on the parameter's device (it refuses a CPU one)."""
    for opt in getattr(t.optimizer, "chained_optimizers", None) or [t.optimizer]:
        inner = opt.optimizer
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if group.get("fused") and isinstance(step, torch.Tensor):
                    assert step.device == p.device, (step.device, p.device)


def advantage_weighted_nll(args, mb, log_probs, entropy, agg):
    """A custom loss as a plugin writes it: the micro-batch's tensors next to the log-probs."""
    loss = agg([-a * lp for a, lp in zip(mb["advantages"], log_probs)], mb["loss_masks"])
    return loss, {"custom_loss": loss.detach()}


LOSS_VARIANTS = {
    "grpo": ([], {}),
    "tis": (["--use-tis"], {}),
    "mis": (["--use-mis"], {}),
    "kl_loss": (["--use-kl-loss", "--kl-loss-coef", "0.1"], {}),
    "entropy": (["--entropy-coef", "0.01"], {}),
    "custom": ([], {"custom_loss_function_path": f"{__name__}.advantage_weighted_nll"}),
    "sft": (["--loss-type", "sft_loss"], {}),
}


@pytest.mark.parametrize("variant", list(LOSS_VARIANTS))
def test_each_loss_variant_trains_on_the_gpu(tiny_qwen3, variant):
    extra, values = LOSS_VARIANTS[variant]
    with gpu_trainer(tiny_qwen3, *extra, "--num-steps-per-rollout", "2", **values) as t:
        assert_on_gpu(t)
        metrics = t.train(0, with_rollout_log_probs(t, make_rollout(seed=40)))
    assert metrics["train/steps"] == 2
    assert_trained(metrics)
    expected = {"tis": "train/tis_weight_mean", "mis": "train/mis_weight_mean", "kl_loss": "train/kl_loss",
                "custom": "train/custom_loss", "sft": "train/sft_loss"}.get(variant, "train/pg_loss")
    assert expected in metrics, metrics


@pytest.mark.parametrize("mode", ["loss", "reward"])
def test_on_policy_distillation_trains_on_the_gpu(tiny_qwen3, mode):
    """The student as its own teacher, the engine's log-probs the student's own: the reverse KL starts at 0."""
    with gpu_trainer(tiny_qwen3, "--opd-teacher-checkpoint", str(tiny_qwen3), "--opd-mode", mode) as t:
        assert all(v.device == t.device for sd in t.teacher_state for v in sd.values())
        metrics = t.train(0, with_rollout_log_probs(t, make_rollout(seed=41)))
    assert_trained(metrics)
    assert metrics["train/opd_reverse_kl"] == pytest.approx(0.0, abs=_tolerance("logprob", torch.float32))


@pytest.mark.parametrize("config", CONFIGS)
def test_ppo_critic_trains_on_the_gpu(tiny_qwen3, config):
    groups = make_rollout(seed=42)
    samples = flat(groups)
    returns = [[float(s["reward"])] * s["response_length"] for s in samples]
    with gpu_trainer(tiny_qwen3, "--advantage-estimator", "ppo", *CONFIGS[config], role="critic") as c:
        assert_on_gpu(c)
        head = c.model[0].module.output_layer.weight
        assert head.device == c.device and head.dtype == next(c.model[0].module.parameters()).dtype
        values = c.compute_values(groups)
        assert all(v == 0.0 for vs in values.values() for v in vs)  # the zero-initialised head
        metrics = c.train_critic(0, groups, values, returns)
        after = c.compute_values(groups)
    assert_trained(metrics, "critic")
    assert any(v != 0.0 for vs in after.values() for v in vs)


def test_ppo_actor_takes_the_critics_values_on_the_gpu(tiny_qwen3):
    groups = make_rollout(seed=43)
    values = {i: [0.1] * s["response_length"] for i, s in enumerate(flat(groups))}
    with gpu_trainer(tiny_qwen3, "--advantage-estimator", "ppo") as t:
        metrics = t.train(0, groups, values=values)
        assert t.get_returns() is not None
    assert_trained(metrics)


def test_single_lora_trains_only_its_adapters_on_the_gpu(tiny_qwen3):
    from vime.trainer.megatron.lora import is_lora_parameter

    groups = make_rollout(seed=44)
    with gpu_trainer(tiny_qwen3, "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2") as t:
        assert_on_gpu(t)
        before = {n: p.detach().clone() for n, p in t.model[0].module.named_parameters()}
        metrics = t.train(0, groups)
        changed = {n for n, p in t.model[0].module.named_parameters() if not torch.equal(before[n], p)}
    assert_trained(metrics)
    assert changed and all(is_lora_parameter(n) for n in changed), changed


def test_multi_lora_routes_each_sample_through_its_adapter_on_the_gpu(tiny_qwen3, tmp_path):
    from vime.data.sample import ADAPTER_KEY

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    groups = make_rollout(seed=45)
    for k, group in enumerate(groups):
        for s in group:
            s["metadata"] = {**s.get("metadata", {}), ADAPTER_KEY: ("math", "code")[k % 2]}
    with gpu_trainer(tiny_qwen3, "--lora-rank", "4", "--lr", "1e-2", "--weight-decay", "0",
                     "--lora-adapters", f"math={prompts}", f"code={prompts}:f1") as t:
        metrics = t.train(0, groups)
    assert_trained(metrics)


def _one_step(hf_dir, groups, *argv, **values):
    """(metrics, {param name: main_grad}) of one step of a fresh trainer."""
    with gpu_trainer(hf_dir, "--entropy-coef", "0.01", *argv, **values) as t:
        metrics = t.train(0, groups)
        grads = {n: p.main_grad.detach().float().cpu() for m in t.model for n, p in m.module.named_parameters()}
    return metrics, grads


@pytest.fixture(scope="module")
def packed_step(tiny_qwen3):
    groups = make_rollout(seed=46)
    return groups, _one_step(tiny_qwen3, groups, "--no-share-group-prompts")


@pytest.mark.parametrize("argv, values", [
    (["--share-group-prompts"], {}),
    (["--qkv-format", "bshd"], {}),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "256"], {}),
    ([], dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    ([], dict(recompute_granularity="selective")),
], ids=["shared-prompts", "bshd", "dynamic-batch-size", "recompute-full", "recompute-selective"])
def test_layouts_give_the_packed_step(tiny_qwen3, packed_step, argv, values):
    """Shared prompts, padded micro-batches, dynamic batch size and recompute change no number beyond the GPU
    kernels' rounding: the same loss and gradients as the plain packed step."""
    groups, (expected, expected_grads) = packed_step
    metrics, grads = _one_step(tiny_qwen3, groups, *argv, **values)
    assert_trained(metrics)
    assert metrics["train/loss"] == pytest.approx(expected["train/loss"], abs=_tolerance("loss", torch.float32))
    worst = max((grads[n] - expected_grads[n]).abs().max().item() for n in grads)
    assert worst <= _tolerance("grad", torch.float32), worst


def test_moe_with_routing_replay_and_the_aux_loss_on_the_gpu(tmp_path):
    from vime.synthetic.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "moe", seed=3, arch="qwen3_moe")
    groups = make_rollout(seed=47)
    with gpu_trainer(model, "--use-routing-replay", "--moe-aux-loss-coeff", "0.01", "--global-batch-size", "8") as t:
        assert_on_gpu(t)
        metrics = t.train(0, groups)
    assert metrics["train/steps"] == 2
    assert_trained(metrics)
    assert math.isfinite(metrics["train/moe_aux_loss"]) and metrics["train/moe_aux_loss"] > 0, metrics
    assert metrics["train/moe_load_imbalance"] >= 1.0, metrics


def test_offload_with_reference_and_teacher_then_train(tiny_qwen3):
    with gpu_trainer(tiny_qwen3, "--use-kl-loss", "--kl-loss-coef", "0.1",
                     "--opd-teacher-checkpoint", str(tiny_qwen3)) as t:
        groups = with_rollout_log_probs(t, make_rollout(seed=48))
        first = t.train(0, groups)
        before = {n: p.detach().clone() for n, p in t.model[0].module.named_parameters()}
        assert t.offload() > 0
        assert t.onload() > 0
        assert all(torch.equal(before[n], p) for n, p in t.model[0].module.named_parameters())
        assert_on_gpu(t)
        assert all(v.device == t.device for state in (t.ref_state, t.teacher_state) for sd in state
                   for v in sd.values())
        second = t.train(1, groups)
        adam_steps_with_their_parameters(t)
    assert_trained(first)
    assert_trained(second)


def test_reduce_over_an_nccl_group_with_data_parallel_forced_to_2(tiny_qwen3):
    """The step metrics' all-reduce over Megatron's data-parallel group (NCCL on a GPU, a group of one here):
    with the size forced to 2 the collective runs, on the GPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from vime.trainer.step_metrics import reduce_step_metrics

    with gpu_trainer(tiny_qwen3) as t:
        assert "nccl" in dist.get_backend(parallel_state.get_data_parallel_group())
        device = t.device
        out = reduce_step_metrics([
            {"loss": torch.tensor(0.5, device=device), "logprob_diff_max": torch.tensor(0.25, device=device),
             "custom": 1.0},
            {"loss": torch.tensor(0.25, device=device), "logprob_diff_max": torch.tensor(0.75, device=device),
             "custom": 2.0}], 2, device)
    assert all(v.device == device for v in out.values())
    assert {k: v.item() for k, v in out.items()} == {"custom": 3.0, "logprob_diff_max": 0.75, "loss": 0.75}


def _save_on_cpu(hf_dir, argv: list[str], save: str, groups, out: Path) -> None:
    """Train one rollout and save it in a process that sees no GPU (a CPU run's checkpoint)."""
    spec = {"argv": ["--hf-checkpoint", str(hf_dir), *BASE_ARGV, *argv, "--save", save], "data": {"0": groups},
            "train": [0], "save": 0, "world_size": 1, "port": None, "out": str(out)}
    from vime.utils.misc import find_free_port

    spec["port"] = find_free_port()
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    script = REPO / "tests" / "helpers" / "trainer_runs.py"
    code = (f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); "
            "from tests.gpu.conftest import allow_parsing_without_vllm; allow_parsing_without_vllm(); "
            f"sys.argv = [{str(script)!r}, *sys.argv[1:]]; runpy.run_path({str(script)!r}, run_name='__main__')")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-c", code, str(out / "spec.json"), "0"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("config", ["fp32", "fp32-distopt"])
def test_a_cpu_saved_checkpoint_resumes_on_the_gpu(tiny_qwen3, tmp_path, config):
    data = [make_rollout(seed=50 + r) for r in range(2)]
    save = str(tmp_path / "ckpt")
    _save_on_cpu(tiny_qwen3, list(CONFIGS[config]), save, data[0], tmp_path / "cpu_run")
    with gpu_trainer(tiny_qwen3, *CONFIGS[config], "--load", save) as t:
        assert t.get_loaded_state()["rollout_id"] == 0 and t.step == 1
        assert_on_gpu(t)
        adam_steps_with_their_parameters(t)
        metrics = t.train(1, data[1])
        adam_steps_with_their_parameters(t)
    assert_trained(metrics)
