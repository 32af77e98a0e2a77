"""Contract tests for the training-side function-path hooks, on the real (one-process) Megatron trainer:
--custom-loss-function-path and --custom-advantage-function-path receive what their documented signatures say and
what they return is what gets optimised."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from tests.helpers.rollouts import flat, make_rollout
from tests.helpers.trainer_runs import local_trainer

PLUGIN = textwrap.dedent('''
    import torch

    SEEN = {}

    def loss(args, micro_batch, log_probs, entropy, aggregate):
        SEEN["keys"] = sorted(micro_batch)
        SEEN["shapes"] = [(lp.shape, e.shape, m.shape) for lp, e, m in
                          zip(log_probs, entropy, micro_batch["loss_masks"])]
        nll = aggregate([-lp for lp in log_probs], micro_batch["loss_masks"])
        return nll, {"my_nll": nll.detach()}

    def advantages(rewards, loss_masks, *, n_samples_per_prompt, **kwargs):
        SEEN["adv_kwargs"] = sorted(kwargs)
        SEEN["n"] = n_samples_per_prompt
        # every token of every sample gets advantage +1 -> behaves like SFT on all samples
        ones = [torch.ones(len(m)) * m for m in loss_masks]
        return ones, ones
''')


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    (tmp_path / "train_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("train_plugin", None)
    yield __import__("train_plugin")
    sys.modules.pop("train_plugin", None)


def test_custom_loss_function(plugin, tiny_qwen3):
    groups = make_rollout(seed=11)
    samples = flat(groups)
    with local_trainer(tiny_qwen3, "--custom-loss-function-path", "train_plugin.loss") as t:
        nll = -torch.cat([torch.tensor(t.probe_log_probs(s["tokens"], s["response_length"])) for s in samples])
        first = t.train(0, groups)
        second = t.train(1, groups)
    assert {"loss_masks", "tokens", "rollout_log_probs", "response_lengths"} <= set(plugin.SEEN["keys"])
    assert all(lp == e == m for lp, e, m in plugin.SEEN["shapes"])  # per-token tensors line up
    assert first["train/my_nll"] == pytest.approx(nll.mean().item(), abs=1e-5)  # its metric is reported
    assert first["train/loss"] == pytest.approx(first["train/my_nll"], abs=1e-6)  # its loss is what is optimised
    assert second["train/loss"] < first["train/loss"]


def test_custom_advantage_function(plugin, tiny_qwen3):
    groups = make_rollout(seed=12)
    samples = flat(groups)
    with local_trainer(tiny_qwen3, "--custom-advantage-function-path", "train_plugin.advantages") as t:
        before = [sum(t.probe_log_probs(s["tokens"], s["response_length"])) for s in samples]
        t.train(0, groups)
        after = [sum(t.probe_log_probs(s["tokens"], s["response_length"])) for s in samples]
    assert plugin.SEEN["n"] == 4
    assert {"kl", "values", "kl_coef", "gamma", "lambd", "normalize_std", "eps"} <= set(plugin.SEEN["adv_kwargs"])
    # advantage +1 everywhere raises every sample's likelihood, rewarded or not
    assert sum(a > b for a, b in zip(after, before)) >= 0.9 * len(samples)
