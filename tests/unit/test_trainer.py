"""MegatronTrainer on real Megatron-core, one CPU process: learning happens, metrics mean what they say,
failed samples are inert, and a checkpoint restart continues exactly where the run stopped.

Most tests build the trainer in this process (`trainer(...)` tears Megatron's groups down afterwards); the
restart test runs each phase in a fresh process (`tests/helpers/trainer_runs.py`).
"""

from __future__ import annotations

import copy
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance, trained_weights_tolerance  # noqa: E402
from tests.helpers.rollouts import flat, make_rollout  # noqa: E402
from tests.helpers.trainer_runs import BASE_ARGV, launch, local_trainer as trainer  # noqa: E402
from vime.data.sample import Sample  # noqa: E402


def weights(t) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in t.hf_weights()}


def probe(t, samples: list[dict]) -> list[torch.Tensor]:
    return [torch.tensor(t.probe_log_probs(s["tokens"], s["response_length"])) for s in samples]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_loss_decreases_and_parameters_change(tiny_qwen3, lora):
    """LoRA: the adapted projections move (merged), the embeddings and norms stay the checkpoint's."""
    groups = make_rollout(seed=1)
    samples = flat(groups)
    extra = ("--lora-rank", "8", "--lr", "1e-2") if lora else ()
    with trainer(tiny_qwen3, "--loss-type", "sft_loss", *extra) as t:
        before = weights(t)
        nll = -torch.cat(probe(t, samples))
        losses = [t.train(r, groups)["train/loss"] for r in range(4)]
        after = weights(t)
    # The loss is the token mean of the response tokens' negative log-likelihood under the current weights (the
    # training forward against the probe's: within a log-prob's tolerance)
    assert losses[0] == pytest.approx(nll.mean().item(), abs=output_tolerance("logprob"))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses
    assert before.keys() == after.keys()
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    if lora:
        assert unchanged and all(n.endswith("_proj.weight") != (n in unchanged) for n in before), unchanged
    else:
        assert not unchanged, f"parameters not trained: {unchanged}"


def test_grpo_raises_rewarded_and_lowers_unrewarded_responses(tiny_qwen3):
    groups = make_rollout(seed=2)
    samples = flat(groups)
    with trainer(tiny_qwen3) as t:
        start = [lp.sum().item() for lp in probe(t, samples)]
        for r in range(3):
            metrics = t.train(r, groups)
            assert metrics["train/steps"] == 1 and metrics["train/grad_norm"] > 0
        end = [lp.sum().item() for lp in probe(t, samples)]
    for s, a, b in zip(samples, start, end):
        if s["reward"] > 0:
            assert b > a, f"rewarded sample {s['index']}: log-prob {a:.3f} -> {b:.3f}"
        else:
            assert b < a, f"unrewarded sample {s['index']}: log-prob {a:.3f} -> {b:.3f}"


def test_rollout_logprob_diff_measures_the_train_inference_gap(tiny_qwen3):
    groups = make_rollout(seed=3)
    samples = flat(groups)
    with trainer(tiny_qwen3) as t:
        # Rollout 0: log-probs off by exactly +-0.1 on trainable tokens; masked-out tokens off by 5, ignored.
        perturbed = copy.deepcopy(groups)
        for k, (s, lp) in enumerate(zip(flat(perturbed), probe(t, samples))):
            mask = torch.ones(len(lp))
            if k % 3 == 0:
                mask[::2] = 0
            s["loss_mask"] = mask.int().tolist()
            s["rollout_log_probs"] = (lp + torch.where(mask.bool(), 0.1 * (-1) ** k, 5.0)).tolist()
        metrics = t.train(0, perturbed)
        off_by = output_tolerance("logprob", cpu=1e-4)  # the training forward against the probe's
        assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(0.1, abs=off_by)
        assert metrics["train_rollout_logprob_abs_diff_max"] == pytest.approx(0.1, abs=off_by)
        # Rollout 1: the trainer's own log-probs for the weights it now has (single-sequence forward, no
        # padding) against the padded micro-batches of the training step.
        exact = copy.deepcopy(groups)
        for s, lp in zip(flat(exact), probe(t, samples)):
            s["rollout_log_probs"] = lp.tolist()
        metrics = t.train(1, exact)
        assert metrics["train_rollout_logprob_abs_diff"] < output_tolerance("logprob")
        assert metrics["train_rollout_logprob_abs_diff_max"] < output_tolerance("logprob")


def _with_failures(groups: list[list[dict]], junk: bool) -> list[list[dict]]:
    """Fail one sample in each of the first three groups; with `junk`, also scramble what failed samples carry."""
    groups = copy.deepcopy(groups)
    g = torch.Generator().manual_seed(99)
    for group, status in zip(groups, (Sample.Status.FAILED, Sample.Status.FAILED, Sample.Status.ABORTED)):
        s = group[1]
        s["status"] = status.value
        if junk:
            s["tokens"] = torch.randint(5, 500, (len(s["tokens"]) + 7,), generator=g).tolist()
            s["response_length"] += 7
            s["reward"] = 1.0 - s["reward"]
    groups[0][1]["reward"] = None  # a failed reward
    return groups


def test_failed_samples_are_inert(tiny_qwen3):
    groups = make_rollout(seed=4)
    results = []
    for junk in (False, True):
        with trainer(tiny_qwen3) as t:
            results.append((t.train(0, _with_failures(groups, junk)), weights(t)))
    (m1, w1), (m2, w2) = results
    assert m1["train/num_usable_samples"] == m2["train/num_usable_samples"] == 13
    # junk changes the padded micro-batches' shapes, so the kernels (and their rounding) may differ
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], abs=output_tolerance("loss")), key
    assert all(torch.allclose(w1[n], w2[n], atol=trained_weights_tolerance(1e-6, lr=1e-3)) for n in w1)


def test_failed_samples_stay_out_of_the_group_baseline(tiny_qwen3):
    """On-policy (ratio 1) the GRPO loss is -sum_i A_i T_i / sum_i T_i over usable samples, with A_i from the
    rewards of the usable samples of its group only: a failed generation is not a zero-reward sibling."""
    groups = make_rollout(seed=4)
    failed = _with_failures(groups, junk=False)
    numerator, tokens = 0.0, 0
    for group in failed:
        usable = [s for s in group if s["status"] == "completed"]
        rewards = torch.tensor([s["reward"] for s in usable])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        numerator += sum(a.item() * s["response_length"] for a, s in zip(advantages, usable))
        tokens += sum(s["response_length"] for s in usable)
    with trainer(tiny_qwen3) as t:
        metrics = t.train(0, failed)
    assert metrics["train/pg_loss"] == pytest.approx(-numerator / tokens, abs=1e-5)


def test_two_steps_per_rollout(tiny_qwen3):
    groups = make_rollout(seed=5)
    with trainer(tiny_qwen3, "--num-steps-per-rollout", "2") as t:
        assert t.args.global_batch_size == 8
        metrics = t.train(0, groups)
        assert metrics["train/steps"] == 2
        assert t.step == 2
        assert t.scheduler.num_steps == 2
    # The second step sees the policy the first step made: old log-probs differ from the current ones.
    assert metrics["train/ppo_kl"] != 0.0


def test_kl_loss_is_zero_against_itself_then_grows(tiny_qwen3):
    groups = make_rollout(seed=6)
    with trainer(tiny_qwen3, "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl") as t:
        metrics = [t.train(r, groups) for r in range(3)]
    assert metrics[0]["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert metrics[1]["train/kl_loss"] > 1e-5
    assert metrics[2]["train/kl_loss"] > metrics[1]["train/kl_loss"]  # the reference stays the starting policy
    for m in metrics:
        assert m["train/loss"] == pytest.approx(m["train/pg_loss"] + 0.1 * m["train/kl_loss"], abs=1e-6)


def test_dynamic_batch_size_gives_the_same_step(tiny_qwen3):
    groups = make_rollout(seed=7)
    results = []
    for extra in ((), ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "64")):
        with trainer(tiny_qwen3, "--entropy-coef", "0.01", *extra) as t:
            results.append([t.train(r, groups) for r in range(2)])
    for fixed, dynamic in zip(*results):
        for key in ("train/loss", "train/entropy", "train/grad_norm"):
            assert dynamic[key] == pytest.approx(fixed[key], abs=output_tolerance("loss", cpu=1e-5)), key


# ---- kill and restart ---------------------------------------------------------------------------------------
RESUME_ARGV = ["--num-steps-per-rollout", "2", "--use-kl-loss", "--kl-loss-coef", "0.1", "--lr-warmup-iters", "2",
               "--lr-decay-style", "linear", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


# (name, ranks, flags): Adam in one process (also a run killed inside a save), the distributed optimizer over two
# data-parallel ranks (its state sharded)
RESTART_CASES = [("adam", 1, ()), ("distributed-optimizer-dp2", 2, ("--use-distributed-optimizer",))]


def test_checkpoint_restart_continues_the_run_exactly(tiny_qwen3, tmp_path):
    """Run A trains rollouts 0..3; run B trains 0..1, saves, exits (and, once, a run killed inside the save of
    rollout 2 after it); a new process loads and trains 2..3.
    Warmup and decay (scheduler), Adam moments, two steps per rollout, the KL reference and dropout (RNG)
    all have to survive the restart for the numbers to agree. The cases run side by side: each is a chain of
    one-thread processes, mostly start-up. A GPU machine runs the cases it has a GPU per rank for."""
    cases = [(name, n, extra) for name, n, extra in RESTART_CASES if not torch.cuda.is_available()
             or torch.cuda.device_count() >= n]
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = {name: pool.submit(_restart_runs, tiny_qwen3, tmp_path / name, n, extra) for name, n, extra in cases}
        runs = {name: run.result() for name, run in runs.items()}
    for name, n, _ in cases:
        _check_restart_continues(tmp_path / name, n, *runs[name])


def _start_results_queue_then_die(pid_file: str) -> None:
    from vime.trainer.megatron.checkpoint import start_results_queue

    pid = start_results_queue()._process.pid
    Path(pid_file).write_text(json.dumps({"pid": pid, "cmdline": Path(f"/proc/{pid}/cmdline").read_text()}))
    os._exit(9)  # as a SIGKILLed rank: no exit handler runs


def test_the_checkpoint_writers_results_queue_is_forked_and_dies_with_its_rank(tmp_path):
    """The Manager serving Megatron's save results: a fork of the rank (not a fresh interpreter importing torch again
    at the first save), gone within seconds of a rank that died without cleaning up."""
    import time

    from tests.helpers import warm_start

    pid_file = tmp_path / "manager.pid"
    rank = warm_start.start(_start_results_queue_then_die, (str(pid_file),), tmp_path / "rank.log", dict(os.environ),
                            tmp_path)
    rank.join(60)
    assert rank.exitcode == 9, (tmp_path / "rank.log").read_text()
    started = json.loads(pid_file.read_text())
    assert "spawn_main" not in started["cmdline"]  # it runs what its rank ran: a fork
    manager = started["pid"]
    deadline = time.monotonic() + 10
    while Path(f"/proc/{manager}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{manager}").exists() or "Z" in Path(f"/proc/{manager}/stat").read_text().split()[2]


def _restart_runs(tiny_qwen3, tmp_path: Path, world_size: int, extra) -> tuple[list[dict], list[dict]]:
    """(run A's reports, the restarted run B's reports), each a list over ranks."""
    argv = ["--hf-checkpoint", str(tiny_qwen3), *BASE_ARGV, *RESUME_ARGV, *extra]
    data = {str(r): make_rollout(seed=10 + r) for r in range(4)}
    spec = {"data": data, "total_steps": 8, "weights": True}
    save = str(tmp_path / "ckpt")
    with ThreadPoolExecutor(2) as pool:  # A and the first half of B are independent
        run_a = pool.submit(launch, {**spec, "argv": argv, "train": [0, 1, 2, 3]}, tmp_path / "a", world_size)
        pool.submit(launch, {**spec, "argv": [*argv, "--save", save], "train": [0, 1], "save": 1}, tmp_path / "b1",
                    world_size).result()
        run_a = run_a.result()
    if world_size == 1:  # a run killed inside its next save (rollout 2's) leaves rollout 1's checkpoint in charge
        launch({**spec, "argv": [*argv, "--load", save, "--save", save], "train": [2], "killed_in_save": 2},
               tmp_path / "b1_killed", world_size, expect_exit=17)
        assert (Path(save) / "iter_0000002.partial").is_dir() and not (Path(save) / "iter_0000002").exists()
    return run_a, launch({**spec, "argv": [*argv, "--load", save], "train": [2, 3]}, tmp_path / "b2", world_size)


def _check_restart_continues(tmp_path: Path, world_size: int, run_a: list[dict], run_b: list[dict]) -> None:
    for a, b in zip(run_a, run_b):
        assert b["loaded_state"]["rollout_id"] == 1
        assert b["step"] == a["step"] == 8
        for r in ("2", "3"):
            assert a["metrics"][r].keys() == b["metrics"][r].keys()
            assert b["metrics"][r]["train/lr"] == pytest.approx(a["metrics"][r]["train/lr"], abs=1e-6), r
            for key in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm"):
                # two processes: GPU kernels need not round alike from run to run (atomics), CPU ones do
                assert b["metrics"][r][key] == pytest.approx(a["metrics"][r][key], abs=output_tolerance("loss")), \
                    (r, key)
    for rank in range(world_size):
        wa = torch.load(tmp_path / "a" / f"weights_rank{rank}.pt")
        wb = torch.load(tmp_path / "b2" / f"weights_rank{rank}.pt")
        assert wa.keys() == wb.keys()
        worst = max((wa[n] - wb[n]).abs().max().item() for n in wa)
        assert worst < trained_weights_tolerance(1e-6, lr=1e-3), worst
