"""Every critic-free advantage estimator (grpo's own tests are in test_trainer.py; ppo's critic runs in the
train-only e2e), CISPO and masked importance sampling in MegatronTrainer on real Megatron-core, one CPU process: the
loss is finite, parameters move, and the metrics are reported."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance  # noqa: E402
from tests.helpers.rollouts import flat, make_rollout  # noqa: E402
from tests.helpers.trainer_runs import local_trainer as trainer  # noqa: E402


def weights(t) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in t.hf_weights()}


def probe(t, samples: list[dict]) -> list[torch.Tensor]:
    return [torch.tensor(t.probe_log_probs(s["tokens"], s["response_length"])) for s in samples]


@pytest.mark.parametrize("estimator, policy_loss", [("gspo", "gspo"), ("reinforce_plus_plus", "ppo"),
                                                    ("reinforce_plus_plus_baseline", "ppo")])
def test_estimator_trains(tiny_qwen3, estimator, policy_loss):
    groups = make_rollout(seed=4)
    with trainer(tiny_qwen3, "--advantage-estimator", estimator) as t:
        assert t.args.policy_loss == policy_loss
        before = weights(t)
        m = t.train(0, groups)
        after = weights(t)
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 and 0.0 <= m["train/pg_clipfrac"] <= 1.0
    assert [n for n in before if torch.equal(before[n], after[n])] == []


def test_cispo_trains(tiny_qwen3):
    groups = make_rollout(seed=5)
    with trainer(tiny_qwen3, "--advantage-estimator", "cispo") as t:
        assert t.args.policy_loss == "cispo"
        before = weights(t)
        runs = [t.train(r, groups) for r in range(2)]
        after = weights(t)
    for m in runs:
        assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
        assert 0.0 <= m["train/pg_clipfrac"] <= 1.0
    assert [n for n in before if torch.equal(before[n], after[n])] == []


def test_sequence_level_mis_masks_the_mismatched_sequences(tiny_qwen3):
    groups = make_rollout(seed=6)
    with trainer(tiny_qwen3, "--use-mis", "--mis-level", "sequence") as t:
        before = weights(t)
        # Every other sample: engine log-probs 0.5 below the trainer's on each token, so the sequence ratio is
        # exp(0.5 * T) >= e^3 > 2 and the sample is masked; the others match the trainer (ratio ~1, kept).
        data = copy.deepcopy(groups)
        for k, (s, lp) in enumerate(zip(flat(data), probe(t, flat(groups)))):
            s["rollout_log_probs"] = (lp - 0.5 * (k % 2)).tolist()
        m = t.train(0, data)
        after = weights(t)
    lengths = [s["response_length"] for s in flat(groups)]
    expected = sum(lengths[1::2]) / sum(lengths)  # token_mean: the masked samples' share of all response tokens
    assert m["train/mis_masked_fraction"] == pytest.approx(expected, abs=1e-6)
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
    assert [n for n in before if torch.equal(before[n], after[n])] == []


@pytest.mark.parametrize("offset, weight", [(0.3, math.exp(0.3)), (1.0, 2.0)])  # e^1 > --tis-clip 2: truncated
def test_tis_weights_the_policy_loss(tiny_qwen3, offset, weight):
    """Engine log-probs `offset` below the trainer's on every token: every TIS weight is exp(offset) (or the clip),
    so on policy (ratio 1) the token-mean policy loss is -weight * mean advantage."""
    groups = make_rollout(seed=9)
    with trainer(tiny_qwen3, "--use-tis") as t:
        data = copy.deepcopy(groups)
        for s, lp in zip(flat(data), probe(t, flat(groups))):
            s["rollout_log_probs"] = (lp - offset).tolist()
        m = t.train(0, data)
    # the training forward's log-probs against the probe's the offset was taken from
    off_by = output_tolerance("logprob")
    assert m["train/tis_weight_mean"] == pytest.approx(weight, abs=off_by)
    assert m["train/pg_loss"] == pytest.approx(-weight * m["train/advantage_mean"], abs=off_by)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(offset, abs=off_by)


def _grpo_by_hand(samples: list[dict], group_size: int = 4) -> list[float]:
    out = []
    for k in range(0, len(samples), group_size):
        rewards = [s["reward"] for s in samples[k:k + group_size]]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        out += [(r - mean) / (std + 1e-6) for r in rewards]
    return out


@pytest.mark.parametrize("mode", ["seq_mean_token_sum", "seq_mean_token_mean"])
def test_loss_aggregation_modes_through_the_trainer(tiny_qwen3, mode):
    """On policy the per-token policy loss is -A_i on each of sample i's T_i tokens: seq_mean_token_sum gives
    -mean_i(A_i * T_i), seq_mean_token_mean -mean_i(A_i), which GRPO's group-centred advantages make 0."""
    groups = make_rollout(seed=10)
    samples = flat(groups)
    advantages = _grpo_by_hand(samples)
    lengths = [s["response_length"] for s in samples]
    per_sequence = [a * n for a, n in zip(advantages, lengths)] if mode == "seq_mean_token_sum" else advantages
    with trainer(tiny_qwen3, "--loss-agg-mode", mode) as t:
        m = t.train(0, groups)
    assert m["train/pg_loss"] == pytest.approx(-sum(per_sequence) / len(samples), abs=1e-5)
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0


def _overlong(n: int, max_len: int = 16, buffer: int = 8) -> float:
    return max(-1.0, min(0.0, -(n - (max_len - buffer)) / buffer))


def test_rloo_with_overlong_shaping_truncation_mask_and_dr_grpo_aggregation(tiny_qwen3):
    """RLOO on rewards + DAPO's overlong penalty, truncated samples masked out, Dr. GRPO's constant normaliser: on
    policy the per-token loss is -A_i, so pg_loss = -sum_i A_i * T_i / (members * 16), all by hand."""
    groups = make_rollout(seed=11)
    samples = flat(groups)
    for k in (1, 6, 11):  # three truncated samples, 16 tokens each as the engine would cut them
        s = samples[k]
        s["tokens"] += [7] * (16 - s["response_length"])
        s["status"], s["response_length"] = "truncated", 16
    lengths = [s["response_length"] for s in samples]
    members = [s["status"] != "truncated" for s in samples]
    shaped = [s["reward"] + _overlong(n) for s, n in zip(samples, lengths)]
    advantages = []
    for g in range(4):
        idx = [i for i in range(4 * g, 4 * g + 4) if members[i]]
        total = sum(shaped[i] for i in idx)
        advantages += [shaped[i] - (total - shaped[i]) / (len(idx) - 1) if members[i] else 0.0
                       for i in range(4 * g, 4 * g + 4)]
    tokens = [a for a, n, m in zip(advantages, lengths, members) if m for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / len(tokens))
    with trainer(tiny_qwen3, "--advantage-estimator", "rloo", "--rollout-max-response-len", "16",
                 "--overlong-buffer-len", "8", "--mask-truncated-samples", "--loss-agg-mode",
                 "seq_mean_token_sum_norm") as t:
        m = t.train(0, groups)
    n_members = sum(members)
    assert m["train/truncated_masked_fraction"] == pytest.approx(3 / 16)
    penalties = [_overlong(n) for n, keep in zip(lengths, members) if keep]
    assert m["train/overlong_penalty_mean"] == pytest.approx(sum(penalties) / n_members, abs=1e-6)
    assert m["train/overlong_penalized_fraction"] == pytest.approx(sum(p < 0 for p in penalties) / n_members)
    assert m["train/advantage_mean"] == pytest.approx(mean, abs=1e-5)
    assert m["train/advantage_std"] == pytest.approx(std, abs=1e-5)
    expected_pg = -sum(a * n for a, n, keep in zip(advantages, lengths, members) if keep) / (n_members * 16)
    assert m["train/pg_loss"] == pytest.approx(expected_pg, abs=1e-5)
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0


def test_remax_entropy_top_fraction_and_entropy_schedule(tiny_qwen3):
    """ReMax's baseline from each sample's metadata; only the top 20% entropy tokens of each micro-batch in the
    loss; the linear schedule's coefficient at rollout 5 of 10."""
    from vime.trainer.train_batch import TrainBatch

    groups = make_rollout(seed=12)
    samples = flat(groups)
    greedy = [0.0, 1.0, 0.5, 0.0]
    for s in samples:
        s["metadata"]["remax_greedy_reward"] = greedy[s["group_index"]]
    advantages = [s["reward"] - greedy[s["group_index"]] for s in samples]
    tokens = [a for a, s in zip(advantages, samples) for _ in range(s["response_length"])]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / len(tokens))
    with trainer(tiny_qwen3, "--advantage-estimator", "remax", "--entropy-top-fraction", "0.2",
                 "--entropy-coef", "0.01", "--entropy-coef-schedule", "linear",
                 "--entropy-coef-decay-rollouts", "10") as t:
        plan = t._split(TrainBatch.from_samples(groups, t.args))
        m = t.train(5, groups)
    assert m["train/advantage_mean"] == pytest.approx(mean, abs=1e-5)
    assert m["train/advantage_std"] == pytest.approx(std, abs=1e-5)
    assert m["train/remax_greedy_reward_mean"] == pytest.approx(sum(greedy) / 4)
    assert m["train/entropy_coef"] == pytest.approx(0.005)
    lengths = [s["response_length"] for s in samples]
    kept = sum(math.ceil(0.2 * sum(lengths[i] for i in mb)) for _, _, mbs in plan for mb in mbs)
    assert m["train/entropy_masked_fraction"] == pytest.approx(1 - kept / sum(lengths), abs=1e-6)
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0


def test_bnpo_averages_the_micro_batches_token_means(tiny_qwen3):
    from vime.trainer.train_batch import TrainBatch

    groups = make_rollout(seed=13)
    samples = flat(groups)
    advantages = _grpo_by_hand(samples)
    with trainer(tiny_qwen3, "--loss-agg-mode", "bnpo") as t:
        plan = t._split(TrainBatch.from_samples(groups, t.args))
        m = t.train(0, groups)
    mbs = [mb for _, _, step_mbs in plan for mb in step_mbs]
    lengths = [s["response_length"] for s in samples]
    per_mb = [-sum(advantages[i] * lengths[i] for i in mb) / sum(lengths[i] for i in mb) for mb in mbs]
    assert len(mbs) > 1
    assert m["train/pg_loss"] == pytest.approx(sum(per_mb) / len(mbs), abs=1e-5)


@pytest.mark.parametrize("loss, extra", [("clip_cov", ("--clip-cov-lb", "0.0", "--clip-cov-ratio", "0.1")),
                                         ("kl_cov", ("--kl-cov-ratio", "0.1"))])
def test_covariance_losses_train(tiny_qwen3, loss, extra):
    """On policy kl_cov's penalty |logp - old| is 0, so its loss is the unclipped -A's token mean; clip_cov cuts
    some tokens' loss. Both mark the tokens they touched in pg_clipfrac."""
    groups = make_rollout(seed=14)
    samples = flat(groups)
    advantages = _grpo_by_hand(samples)
    lengths = [s["response_length"] for s in samples]
    with trainer(tiny_qwen3, "--policy-loss", loss, *extra) as t:
        before = weights(t)
        m = t.train(0, groups)
        after = weights(t)
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 and 0.0 < m["train/pg_clipfrac"] <= 0.5
    if loss == "kl_cov":
        assert m["train/pg_loss"] == pytest.approx(-sum(a * n for a, n in zip(advantages, lengths)) / sum(lengths),
                                                   abs=1e-5)
    assert [n for n in before if torch.equal(before[n], after[n])] == []
