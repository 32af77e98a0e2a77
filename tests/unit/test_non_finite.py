"""NaN and inf without engines or Megatron training: rewards that are not finite fail their sample (stage reward,
reason non_finite) whatever returned them; engine log-probs that are not finite fail theirs; rollout metrics
tolerate failed samples and non-finite rewards; the step guard skips a step on a non-finite loss or gradient
and stops on a non-finite parameter."""

from __future__ import annotations

import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.plugins import rollout_plugin, run as _run
from vime.data.sample import Sample
from vime.rollout.context import reset_rollout_context
from vime.rollout.metrics import rollout_metrics
from vime.rollout.vllm_rollout import generate_and_rm_group

PLUGIN = textwrap.dedent('''
    def nan_every_other(args, sample):
        return float("nan") if sample.index % 2 else 1.0

    def inf_reward(args, sample):
        return float("inf") if sample.index == 0 else 0.5

    def dict_reward(args, sample):
        return {"acc": float("nan") if sample.index == 1 else 1.0, "len": 3.0}

    def group_reward(args, samples):
        return [float("-inf") if s.index == 2 else 1.0 for s in samples]

    def overflow(args, group):  # a post-process that makes a reward infinite (sample 0 failed already)
        assert group[0].reward is None
        group[2].reward = group[2].reward * 1e308 * 10

    async def generate(args, sample, sampling_params):
        sample.tokens = sample.tokens + [5, 6]
        sample.response_length += 2
        sample.loss_mask = [1, 1]
        sample.rollout_log_probs = [-0.5, float("-inf") if sample.index == 3 else -0.25]
        return sample
''')


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    with rollout_plugin(tmp_path, monkeypatch, "non_finite_plugin", PLUGIN):
        yield


def _args(tiny_qwen3, **kw):
    base = dict(hf_checkpoint=str(tiny_qwen3), rollout_concurrency=64, custom_generate_function_path=
                "non_finite_plugin.generate", rm_type=None, custom_rm_path=None, group_rm=False, rm_timeout=5.0,
                reward_key=None, rollout_seed=0, custom_reward_post_process_path=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _group(n=4):
    return [Sample(group_index=0, index=i, tokens=[1, 2], status=Sample.Status.PENDING) for i in range(n)]


def _failures(samples):
    return {s.index: s.metadata["failure"] for s in samples if s.status == Sample.Status.FAILED}


@pytest.mark.parametrize("kw, failed", [
    (dict(custom_rm_path="non_finite_plugin.nan_every_other"), {1: "nan"}),
    (dict(custom_rm_path="non_finite_plugin.inf_reward"), {0: "inf"}),
    (dict(custom_rm_path="non_finite_plugin.dict_reward", reward_key="acc"), {1: "nan"}),
    (dict(custom_rm_path="non_finite_plugin.group_reward", group_rm=True), {2: "-inf"}),
    (dict(custom_rm_path="non_finite_plugin.inf_reward",
          custom_reward_post_process_path="non_finite_plugin.overflow"), {0: "inf", 2: "inf"}),
], ids=["nan", "inf", "dict_reward_key", "group_rm", "post_process"])
def test_non_finite_rewards_fail_their_sample(tiny_qwen3, plugin, kw, failed):
    out = _run(generate_and_rm_group(_args(tiny_qwen3, **kw), _group(3), {"max_tokens": 4}))
    failures = _failures(out)
    assert set(failures) == set(failed)
    for index, value in failed.items():
        assert failures[index]["stage"] == "reward" and failures[index]["reason"] == "non_finite"
        assert value in failures[index]["error"] and f"of sample {index} is not finite" in failures[index]["error"]
        assert out[index].reward is None and not any(out[index].loss_mask or [])
    for s in out:
        if s.index not in failed:
            assert s.status == Sample.Status.COMPLETED and math.isfinite(s.get_reward_value(_args(tiny_qwen3, **kw)))
            assert s.loss_mask == [1, 1]


def test_non_finite_engine_log_probs_fail_the_sample_before_its_reward(tiny_qwen3, plugin):
    out = _run(generate_and_rm_group(_args(tiny_qwen3, rm_type="random"), _group(4), {"max_tokens": 4}))
    failures = _failures(out)
    assert set(failures) == {3} and failures[3]["stage"] == "generate"
    assert failures[3]["reason"] == "non_finite_log_probs"
    assert "log-prob of response token 1 of sample 3 is -inf" in failures[3]["error"]
    assert out[3].reward is None and out[3].loss_mask == [0, 0] and out[3].rollout_log_probs == [-0.5, 0.0]
    Sample.from_dict(out[3].to_dict())  # the trainer can still read it


def test_rollout_metrics_tolerate_failed_samples_and_non_finite_rewards():
    """Every other reward NaN used to crash statistics.pstdev ('float' object has no attribute 'numerator')."""
    args = SimpleNamespace(reward_key=None)
    failed = Sample(status=Sample.Status.FAILED, response_length=2,
                    metadata={"failure": {"stage": "reward", "reason": "non_finite"}})
    samples = [Sample(status=Sample.Status.COMPLETED, reward=r, response_length=2) for r in (1.0, 0.0, 1.0)]
    reset_rollout_context()
    m = rollout_metrics([failed, *samples, failed], args, prefix="eval/x")
    assert m["eval/x/reward_mean"] == pytest.approx(2 / 3) and m["eval/x/reward_std"] == pytest.approx(2 ** 0.5 / 3)
    assert m["eval/x/failed/reward_non_finite"] == 2 and m["eval/x/failed_samples"] == 2
    assert "eval/x/non_finite_rewards" not in m
    # a custom rollout function may hand over a non-finite reward as scored: left out of the statistics, counted
    scored_nan = [Sample(status=Sample.Status.COMPLETED, reward=r, response_length=2)
                  for r in (float("nan"), 1.0, float("inf"), 0.0)]
    m = rollout_metrics(scored_nan, args, prefix="eval/x")
    assert m["eval/x/reward_mean"] == 0.5 and m["eval/x/reward_std"] == 0.5 and m["eval/x/non_finite_rewards"] == 2
    m = rollout_metrics([failed], args, prefix="eval/x")
    assert m["eval/x/reward_mean"] == 0.0 and m["eval/x/reward_std"] == 0.0


def test_train_batch_treats_a_non_finite_reward_as_unusable():
    from vime.trainer.train_batch import TrainBatch

    groups = [[Sample(index=i, tokens=[1, 2, 3], response_length=2, reward=r, status=Sample.Status.COMPLETED,
                      loss_mask=[1, 1]).to_dict() for i, r in enumerate((1.0, float("nan"), float("-inf"), 0.0))]]
    batch = TrainBatch.from_samples(groups, SimpleNamespace(reward_key=None))
    assert batch.num_usable == 2 and batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert [m.tolist() for m in batch.loss_masks] == [[1, 1], [0, 0], [0, 0], [1, 1]]


# ---------------------------------------------------------------------------------------------- the step guard


class _Optimizer:
    def __init__(self):
        self.steps, self.param_groups, self.zeroed = 0, [{"lr": 0.1}], 0

    def zero_grad(self):
        self.zeroed += 1

    def step(self):
        self.steps += 1
        return True, 1.0, None


def _model(grad: float):
    layer = torch.nn.Linear(2, 2)
    for p in layer.parameters():
        p.main_grad = torch.full_like(p, 0.5)
    layer.weight.main_grad[0, 1] = grad
    return [layer]


@pytest.mark.parametrize("grad, loss, reason", [(0.1, 1.0, None), (float("nan"), 1.0, "non_finite_grad_norm"),
                                                (float("inf"), 1.0, "non_finite_grad_norm"),
                                                (0.1, float("nan"), "non_finite_loss")])
def test_the_guard_skips_the_step_on_a_non_finite_loss_or_gradient(grad, loss, reason):
    from vime.trainer.non_finite import FiniteStepGuard

    optimizer = _Optimizer()
    guard = FiniteStepGuard(optimizer, _model(grad))
    loss_fn = guard.watch(lambda indices, inputs, output: (torch.tensor(loss), {}))
    assert loss_fn([0], None, None)[0].item() == pytest.approx(loss, nan_ok=True)
    guard.zero_grad()
    assert guard.param_groups[0]["lr"] == 0.1 and optimizer.zeroed == 1  # the optimizer's own
    assert guard.step() == ((True, 1.0, None) if reason is None else (False, None, None))
    assert guard.reason == reason and optimizer.steps == (reason is None)


def test_with_a_loss_scaler_megatron_decides():
    from vime.trainer.non_finite import FiniteStepGuard

    optimizer = _Optimizer()
    optimizer.grad_scaler = object()  # fp16: the scaler must see the overflow to lower the scale
    guard = FiniteStepGuard(optimizer, _model(float("nan")))
    assert guard.step() == (True, 1.0, None) and guard.reason is None


def test_a_non_finite_parameter_after_a_step_stops_the_run():
    from vime.trainer.non_finite import check_finite_parameters

    model = _model(0.1)
    check_finite_parameters(model, 3)
    with torch.no_grad():
        model[0].bias[1] = float("inf")
    with pytest.raises(RuntimeError, match="optimizer step 3 left parameter bias non-finite"):
        check_finite_parameters(model, 3)
