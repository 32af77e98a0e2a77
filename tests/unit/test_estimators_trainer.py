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
