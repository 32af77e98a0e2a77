"""MegatronTrainer on CUDA (skipped without a GPU): the CPU unit tests' trainer (tests/unit/test_trainer.py) on a
GPU, in float32 and bfloat16 (--bf16), with torch's Adam and the distributed optimizer.

- A step: the trainer's log-probs equal a float32 transformers forward (eager attention) of the same checkpoint on
  the GPU within vime's tolerance for the trainer's dtype (`vime.utils.tolerances`): the one-sequence probe, and the
  packed micro-batches of the training step (`train_rollout_logprob_abs_diff`, the reference being the rollout's
  log-probs); then the step moves every weight tensor.
- A checkpoint saved after one rollout loads into a fresh trainer (new process group, new model) with parameters
  and optimizer state (Adam moments, step, float32 master weights) equal bit for bit, and the next rollout then
  trains alike: within tolerance, as GPU kernels are not bit-reproducible (the backward of index_select and of
  fused attention accumulate with atomics).
- With 2 GPUs, DP=2 (one process per GPU) trains like one GPU; skipped with one.

Each trainer is built in this process (`local_trainer`), as the CPU tests do; vLLM is not needed
(tests/gpu/conftest.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
if torch.cuda.is_available():  # without a GPU every test skips: Megatron need not be imported to say so
    pytest.importorskip("megatron.core")

from tests.helpers.hf_reference import load_hf  # noqa: E402
from tests.helpers.rollouts import flat, make_rollout  # noqa: E402
from tests.helpers.trainer_runs import BASE_ARGV, local_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"fp32": (), "fp32-distopt": ("--use-distributed-optimizer",),
           "bf16-distopt": ("--bf16", "--use-distributed-optimizer")}
# the checkpoint test: state beyond Adam's that a resume must restore (warmup and decay, the KL reference's loss)
RESUME_ARGV = ("--lr-warmup-iters", "2", "--lr-decay-style", "linear", "--use-kl-loss", "--kl-loss-coef", "0.1")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _tolerance(kind: str, dtype) -> float:
    from vime.utils.tolerances import tolerance

    return tolerance(kind, dtype, _device())


def _dtype(t) -> torch.dtype:
    """The dtype the trainer computes in: bfloat16 with --bf16 on a GPU (float32 on CPU whatever the flags)."""
    from vime.utils.device import training_dtype

    return getattr(torch, training_dtype(t.args))


def reference_log_probs(model, samples: list[dict]) -> list[torch.Tensor]:
    """Each sample's response-token log-probs from `model` (transformers, on the GPU), one sequence at a time."""
    out = []
    for s in samples:
        ids = torch.tensor([s["tokens"]], device=_device())
        start = len(s["tokens"]) - s["response_length"]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        out.append(logp[start - 1:-1].gather(-1, ids[0, start:, None]).squeeze(-1).cpu())
    return out


def probe(t, samples: list[dict]) -> list[torch.Tensor]:
    return [torch.tensor(t.probe_log_probs(s["tokens"], s["response_length"], temperature=1.0)) for s in samples]


def assert_log_probs_close(got: list[torch.Tensor], reference: list[torch.Tensor], dtype, what: str) -> None:
    """Per token: |got - reference| <= logprob + logprob_relative x |reference| (vime.utils.tolerances)."""
    absolute, relative = _tolerance("logprob", dtype), _tolerance("logprob_relative", dtype)
    assert len(got) == len(reference)
    for k, (g, r) in enumerate(zip(got, reference)):
        assert g.shape == r.shape, (what, k, g.shape, r.shape)
        diff = (g.double() - r.double()).abs()
        bound = absolute + relative * r.double().abs()
        assert bool((diff <= bound).all()), f"{what}, sample {k}: max |diff| {diff.max().item():.3g} > {absolute:g}"


def weights(t) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in t.hf_weights()}


@pytest.mark.parametrize("config", CONFIGS)
def test_training_step_matches_transformers_and_moves_weights(tiny_qwen3, config):
    groups = make_rollout(seed=1)
    samples = flat(groups)
    reference = reference_log_probs(load_hf(tiny_qwen3).to(_device()), samples)
    # lr 1e-2: Adam's first step then moves a bfloat16 weight near 1 (a norm) by more than half its ulp (2^-8)
    with local_trainer(tiny_qwen3, *CONFIGS[config], "--lr", "1e-2") as t:
        dtype = _dtype(t)
        if torch.cuda.is_available():
            assert dtype == (torch.bfloat16 if "--bf16" in CONFIGS[config] else torch.float32)
        params = [p for m in t.model for p in m.parameters()]
        assert all(p.device.type == _device().type for p in params)
        # every weight in the trainer's dtype, the norms' too (their fused kernel needs the input's dtype)
        assert all(p.dtype == dtype for p in params)
        assert_log_probs_close(probe(t, samples), reference, dtype, "probe_log_probs vs transformers")
        for s, lp in zip(samples, reference):  # the reference as the rollout's log-probs: the step measures the gap
            s["rollout_log_probs"] = lp.tolist()
        before = weights(t)
        metrics = t.train(0, groups)
        after = weights(t)
    assert metrics["train/steps"] == 1 and metrics["train/skipped_steps"] == 0, metrics
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0, metrics
    largest = max(r.abs().max().item() for r in reference)
    assert metrics["train_rollout_logprob_abs_diff"] <= _tolerance("logprob", dtype), metrics
    assert metrics["train_rollout_logprob_abs_diff_max"] <= _tolerance("logprob", dtype) + \
        _tolerance("logprob_relative", dtype) * largest, metrics
    assert before.keys() == after.keys() and before
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"parameters not trained: {unchanged}"
    assert all(torch.isfinite(w.float()).all() for w in after.values())


def train_state(t) -> dict[str, torch.Tensor]:
    """Every model parameter, and each parameter the optimizer updates (its float32 master copy or shard in 16-bit
    or with the distributed optimizer) with its Adam state, copied to host memory, keyed by position."""
    state = {}
    for i, chunk in enumerate(t.model):
        for name, p in chunk.module.named_parameters():
            state[f"model{i}.{name}"] = p.detach().cpu().clone()
    for k, opt in enumerate(getattr(t.optimizer, "chained_optimizers", None) or [t.optimizer]):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                state[f"optimizer{k}.group{g}.{j}"] = p.detach().cpu().clone()
                for key, value in inner.state.get(p, {}).items():
                    state[f"optimizer{k}.group{g}.{j}.{key}"] = torch.as_tensor(value).detach().cpu().clone()
    return state


def assert_same_state(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    assert saved.keys() == loaded.keys()
    assert any(k.endswith(".exp_avg_sq") for k in saved), "no Adam state: the optimizer never stepped"
    for key, a in saved.items():
        b = loaded[key]
        if key.endswith(".step"):  # where torch keeps it (host or device, float32) depends on the kernel
            assert float(a) == float(b), (key, float(a), float(b))
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{key}: loaded != saved"


@pytest.mark.parametrize("config", CONFIGS)
def test_checkpoint_round_trip_is_bit_exact(tiny_qwen3, tmp_path, config):
    from vime.trainer.megatron.checkpoint_files import publish

    save = str(tmp_path / "ckpt")
    data = [make_rollout(seed=30 + r) for r in range(2)]
    probes = flat(data[1])[:4]
    argv = (*CONFIGS[config], *RESUME_ARGV)
    with local_trainer(tiny_qwen3, *argv, "--save", save) as a:
        dtype = _dtype(a)
        a.train(0, data[0])
        a.save(0, {})
        publish(save, 0)  # what the run's driver does once every part is saved
        saved, saved_step = train_state(a), a.step
        next_a = a.train(1, data[1])
        after_a = probe(a, probes)
    with local_trainer(tiny_qwen3, *argv, "--load", save) as b:
        assert b.get_loaded_state()["rollout_id"] == 0 and b.step == saved_step == 1
        assert_same_state(saved, train_state(b))
        next_b = b.train(1, data[1])
        after_b = probe(b, probes)
    assert next_b["train/lr"] == next_a["train/lr"]  # the scheduler's state: plain numbers, exact
    for key, kind in (("train/loss", "loss"), ("train/pg_loss", "loss"), ("train/kl_loss", "loss"),
                      ("train/grad_norm", "grad")):
        assert next_b[key] == pytest.approx(next_a[key], abs=_tolerance(kind, dtype)), (key, next_a, next_b)
    assert_log_probs_close(after_b, after_a, dtype, "after the step following the load")


# ---- several GPUs ----------------------------------------------------------------------------------------------
def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# A rank of tests/helpers/trainer_runs.py, with vime's flags parsed as in this process (tests/gpu/conftest.py)
RANK_MAIN = """
import runpy, sys
sys.path.insert(0, {repo!r})
from tests.gpu.conftest import allow_parsing_without_vllm
allow_parsing_without_vllm()
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def launch_one_per_gpu(spec: dict, out_dir: Path, world_size: int, timeout_s: float = 180.0) -> list[dict]:
    """`trainer_runs.launch` with GPU r alone visible to rank r (each rank then computes on its cuda:0, as under
    Ray); the ranks' reports."""
    from vime.utils.misc import find_free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "world_size": world_size, "port": find_free_port(),
                                     "out": str(out_dir)}))
    code = RANK_MAIN.format(repo=str(REPO), script=str(REPO / "tests" / "helpers" / "trainer_runs.py"))
    procs, logs = [], [out_dir / f"rank{r}.log" for r in range(world_size)]
    for rank, log in enumerate(logs):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        env.pop("WORLD_SIZE", None)
        with log.open("w") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", code, str(spec_path), str(rank)], env=env,
                                          cwd=REPO, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:  # a rank that fails leaves the other waiting in a collective: stop both at the first failure
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            assert time.monotonic() < deadline, f"ranks did not finish within {timeout_s} s"
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{logs[rank].read_text()[-6000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (DP=2, one process per GPU)")
def test_two_gpus_train_like_one(tiny_qwen3, tmp_path):
    """As tests/unit/test_trainer_parallel.py's dp2 case: same global batch, one optimizer step per rollout, an
    entropy bonus so that rollout 1's loss shows the weights the first step made."""
    extra = ["--entropy-coef", "0.01", "--use-distributed-optimizer"]
    data = {str(r): make_rollout(seed=20 + r) for r in range(2)}
    with local_trainer(tiny_qwen3, *extra) as t:
        dtype = _dtype(t)
        one = [t.train(r, data[str(r)]) for r in range(2)]
    argv = ["--hf-checkpoint", str(tiny_qwen3), *BASE_ARGV, *extra]
    reports = launch_one_per_gpu({"argv": argv, "data": data, "train": [0, 1]}, tmp_path, world_size=2)
    for rank, report in enumerate(reports):  # DP=2: every rank is a last-stage TP-rank 0, and reports
        for r, expected in enumerate(one):
            got = report["metrics"][str(r)]
            assert got["train/steps"] == 1 and got["train/num_usable_samples"] == 16
            for key, kind in (("train/loss", "loss"), ("train/pg_loss", "loss"), ("train/entropy", "loss"),
                              ("train/grad_norm", "grad")):
                assert got[key] == pytest.approx(expected[key], abs=_tolerance(kind, dtype)), (rank, r, key)
