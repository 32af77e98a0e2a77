"""MegatronTrainer on real Megatron-core (fp32, one CPU process) against NaN and inf: a non-finite loss skips the
optimizer step and names the reason, leaving every weight as it was; a non-finite reward leaves its sample out;
a step that leaves a parameter non-finite stops the run before the weights can be sent."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.rollouts import make_rollout  # noqa: E402
from tests.helpers.trainer_runs import local_trainer as trainer  # noqa: E402

LOSS_PLUGIN = textwrap.dedent('''
    def nan_loss(args, mb, log_probs, entropy, agg):
        """The token-mean NLL times NaN: what a NaN advantage or a NaN log-prob does to a policy loss."""
        loss = agg([-lp * float("nan") for lp in log_probs], [m.to(lp.device) for m, lp in zip(mb["loss_masks"],
                                                                                                 log_probs)])
        return loss, {}
''')


def weights(t) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in t.hf_weights()}


@pytest.fixture()
def loss_plugin(tmp_path, monkeypatch):
    (tmp_path / "nan_loss_plugin.py").write_text(LOSS_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "nan_loss_plugin.nan_loss"
    sys.modules.pop("nan_loss_plugin", None)


def test_a_non_finite_loss_skips_the_step_and_names_the_reason(tiny_qwen3, loss_plugin, caplog):
    with trainer(tiny_qwen3, "--custom-loss-function-path", loss_plugin) as t:
        before = weights(t)
        metrics = t.train(0, make_rollout(seed=7))
        after = weights(t)
    assert metrics["train/skipped_steps"] == 1 and metrics["train/skipped/non_finite_loss"] == 1
    assert "step 0 skipped: non finite loss" in caplog.text
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing was applied


def test_a_non_finite_reward_leaves_its_sample_out_and_the_weights_finite(tiny_qwen3):
    groups = make_rollout(seed=8)
    groups[1][2]["reward"], groups[3][0]["reward"] = float("nan"), float("inf")  # a custom rollout's rewards
    with trainer(tiny_qwen3) as t:
        before = weights(t)
        metrics = t.train(0, groups)
        after = weights(t)
    assert metrics["train/num_usable_samples"] == 14 and metrics["train/skipped_steps"] == 0
    assert metrics["train/grad_norm"] > 0 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert all(torch.isfinite(w).all() for w in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the step was taken


def test_a_step_that_makes_a_parameter_non_finite_stops_the_run(tiny_qwen3):
    with trainer(tiny_qwen3, "--lr", "1e39", "--clip-grad", "0") as t:  # Adam moves each weight by about lr
        with pytest.raises(RuntimeError, match=r"optimizer step 0 left parameter \S+ non-finite"):
            t.train(0, make_rollout(seed=9))
