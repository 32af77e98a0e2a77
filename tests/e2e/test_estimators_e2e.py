"""The baselines of issue 41 on the real stack (tiny model, 2 vLLM engines behind vllm-router, Megatron-core, Ray),
two rollouts each, every number the run reports recomputed by hand from what it saved:

- RLOO with DAPO's overlong shaping and Dr. GRPO's aggregation, plus eval pass@1 / pass@4 / maj@4 over 4 samples
  per eval prompt;
- Dr. GRPO (no std normalisation, seq_mean_token_sum_norm) with truncated samples masked out, KL-Cov and a linear
  entropy-coefficient schedule.

On policy (one optimizer step per rollout) the per-token policy loss is -A_i, so the reported pg_loss is
-sum_i A_i * T_i / (members * max response length) for Dr. GRPO's constant normaliser. After each update the
engines' log-probs must equal the trainer's (--check-weight-update-equal, < 1e-5)."""

from __future__ import annotations

import math
from math import comb
from pathlib import Path

import pytest

from tests.e2e.test_loop_e2e import _check_run, _cmd, _metrics, _run
from vime.rollout.debug_data import load_rollout

pytestmark = pytest.mark.e2e
MAX_LEN = 16
# 32 of the tiny model's 512 tokens end a response: its near-uniform sampling then stops about two responses in
# three before 16 tokens, so lengths (and overlong penalties, truncations) vary
STOP = ("--rollout-stop-token-ids", *map(str, range(100, 132)))


def _samples(out: Path, name: str, rollout_id: int):
    return [s for g in load_rollout(str(out / f"rollout_{name}{{rollout_id}}.jsonl"), rollout_id) for s in g]


def _token_stats(per_sample: list[float], lengths: list[int]) -> tuple[float, float]:
    values = [a for a, n in zip(per_sample, lengths) for _ in range(n)]
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _overlong(n: int, buffer: int) -> float:
    return max(-1.0, min(0.0, -(n - (MAX_LEN - buffer)) / buffer))


def _check_dr_grpo_loss(record: dict, advantages: list[float], lengths: list[int], members: list[bool]) -> None:
    n = sum(members)
    expected = -sum(a * t for a, t, m in zip(advantages, lengths, members) if m) / (n * MAX_LEN)
    assert record["train/pg_loss"] == pytest.approx(expected, abs=1e-5), record
    assert math.isfinite(record["train/loss"]), record


def _pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def _majority_correct(samples) -> float:
    answers = [s.response.strip() for s in samples]
    best = max(answers.count(a) for a in answers)
    winner = next(a for a in answers if answers.count(a) == best)
    return float(samples[answers.index(winner)].reward > 0)


def test_rloo_overlong_dr_grpo_aggregation_and_eval_pass_at_k(tiny_qwen3, arithmetic_data, tmp_path):
    buffer = 8
    _run(_cmd("train.py", tiny_qwen3, arithmetic_data[0], tmp_path, 2, "--advantage-estimator", "rloo",
              "--overlong-buffer-len", str(buffer), "--loss-agg-mode", "seq_mean_token_sum_norm",
              "--eval-prompt-data", "arith", str(arithmetic_data[1]), "--eval-interval", "100",
              "--n-samples-per-eval-prompt", "4", "--eval-pass-at-k", "1,4", *STOP))
    records = _metrics(tmp_path)
    train = [r for r in records if "train/steps" in r]
    _check_run(train, [0, 1], on_policy=True)
    for r in train:
        assert r["train/steps"] == 1, r  # on policy: the loss is -A per token
        samples = _samples(tmp_path, "", r["rollout_id"])
        lengths = [s.response_length for s in samples]
        penalties = [_overlong(n, buffer) for n in lengths]
        shaped = [s.reward + p for s, p in zip(samples, penalties)]
        advantages = []
        for g in range(0, len(shaped), 4):  # leave-one-out: the mean of the other three
            group = shaped[g:g + 4]
            advantages += [x - (sum(group) - x) / 3 for x in group]
        mean, std = _token_stats(advantages, lengths)
        assert r["train/advantage_mean"] == pytest.approx(mean, abs=1e-5), r
        assert r["train/advantage_std"] == pytest.approx(std, abs=1e-5), r
        assert r["train/overlong_penalty_mean"] == pytest.approx(sum(penalties) / len(penalties), abs=1e-6), r
        assert r["train/overlong_penalized_fraction"] == pytest.approx(
            sum(p < 0 for p in penalties) / len(penalties)), r
        _check_dr_grpo_loss(r, advantages, lengths, [True] * len(samples))

    evals = [r for r in records if "eval/arith/pass@1" in r]
    assert [r["rollout_id"] for r in evals] == [0, 2]
    for r in evals:
        samples = _samples(tmp_path, "eval_arith_", r["rollout_id"])
        prompts = [samples[k:k + 4] for k in range(0, len(samples), 4)]
        assert len(prompts) == 16 and all(len({s.group_index for s in p}) == 1 for p in prompts)
        for k in (1, 4):
            expected = sum(_pass_at_k(4, sum(s.reward > 0 for s in p), k) for p in prompts) / len(prompts)
            assert r[f"eval/arith/pass@{k}"] == pytest.approx(expected, abs=1e-9), r
        assert r["eval/arith/maj@4"] == pytest.approx(sum(map(_majority_correct, prompts)) / len(prompts)), r
        assert r["eval/arith/mean@4"] == pytest.approx(sum(s.reward for s in samples) / len(samples)), r
        assert r["eval/arith/pass@1"] == pytest.approx(r["eval/arith/reward_mean"]), r  # pass@1 = mean of 0/1


def test_dr_grpo_truncated_masked_kl_cov_entropy_schedule(tiny_qwen3, arithmetic_data, tmp_path):
    _run(_cmd("train.py", tiny_qwen3, arithmetic_data[0], tmp_path, 2, "--disable-grpo-std-normalization",
              "--loss-agg-mode", "seq_mean_token_sum_norm", "--mask-truncated-samples", "--policy-loss", "kl_cov",
              "--kl-cov-ratio", "0.05", "--entropy-coef", "0.01", "--entropy-coef-schedule", "linear",
              "--entropy-coef-decay-rollouts", "2", *STOP))
    train = [r for r in _metrics(tmp_path) if "train/steps" in r]
    _check_run(train, [0, 1], on_policy=True)
    for r in train:
        samples = _samples(tmp_path, "", r["rollout_id"])
        lengths = [s.response_length for s in samples]
        members = [s.status.value != "truncated" for s in samples]
        assert r["train/truncated_masked_fraction"] == pytest.approx(1 - sum(members) / len(samples)), r
        advantages = []
        for g in range(0, len(samples), 4):  # r - mean over the group's untruncated members, no std
            kept = [s.reward for s, m in zip(samples[g:g + 4], members[g:g + 4]) if m]
            advantages += [s.reward - sum(kept) / len(kept) if m and len(kept) > 1 else 0.0
                           for s, m in zip(samples[g:g + 4], members[g:g + 4])]
        mean, std = _token_stats([a for a, m in zip(advantages, members) if m],
                                 [n for n, m in zip(lengths, members) if m])
        assert r["train/advantage_mean"] == pytest.approx(mean, abs=1e-5), r
        assert r["train/advantage_std"] == pytest.approx(std, abs=1e-5), r
        _check_dr_grpo_loss(r, advantages, lengths, members)  # on policy KL-Cov's |logp - old| is 0
        assert r["train/pg_clipfrac"] > 0, r  # the penalised tokens
        assert r["train/entropy_coef"] == pytest.approx([0.01, 0.005][r["rollout_id"]]), r
