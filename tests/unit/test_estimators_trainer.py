"""Every critic-free advantage estimator (grpo's own tests are in test_trainer.py; ppo's critic runs in the
train-only e2e), CISPO and masked importance sampling in MegatronTrainer on real Megatron-core, one CPU process: the
loss is finite, parameters move, and the metrics are reported."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("megatron.core")

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
