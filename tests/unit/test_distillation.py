"""On-policy distillation: the per-token teacher reward and the flags by hand, then through the real
MegatronTrainer (one CPU process) against a teacher that is the student at temperature 1/4: the reported reverse
KL, the reward mode's policy loss and the loss mode's KL term equal hand computations from HF forwards, and
training on the loss pulls the student toward the teacher."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.helpers.devices import output_tolerance
from tests.helpers.hf_reference import load_hf, response_log_probs
from tests.helpers.rollouts import flat, make_rollout
from vime.algorithms.distillation import opd_token_rewards
from vime.synthetic.tempered_model import temper_checkpoint


def test_token_rewards_by_hand():
    student = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-3.0])]
    teacher = [torch.tensor([-1.5, -1.0, -0.5]), torch.tensor([-1.0])]
    masks = [torch.tensor([1, 1, 0]), torch.tensor([0])]
    out = opd_token_rewards(student, teacher, masks, coef=0.5)  # 0.5 * (teacher - student), 0 where masked
    assert [o.tolist() for o in out] == [[-0.25, 0.5, 0.0], [0.0]]
    with pytest.raises(ValueError, match="1 student, 2 teacher"):
        opd_token_rewards(student[:1], teacher, masks, 1.0)
    with pytest.raises(ValueError, match="3 student, 1 teacher"):
        opd_token_rewards(student[:1], [teacher[1]], masks[:1], 1.0)


def test_flags_name_what_is_wrong(tiny_qwen3, tmp_path, capsys):
    from tests.helpers.trainer_runs import BASE_ARGV
    from vime.arguments import parse_args

    base = ["--hf-checkpoint", str(tiny_qwen3), *BASE_ARGV]
    teacher = ["--opd-teacher-checkpoint", str(tiny_qwen3)]
    for extra, message in [(["--opd-teacher-checkpoint", str(tmp_path)], "config.json missing"),
                           ([*teacher, "--opd-coef", "0"], "--opd-coef must be > 0")]:
        with pytest.raises(SystemExit):
            parse_args([*base, *extra])
        assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def sharper_teacher(tiny_qwen3, tmp_path_factory):
    return temper_checkpoint(tiny_qwen3, tmp_path_factory.mktemp("teacher"), temperature=0.25)


def _hf_log_probs(path, samples: list[dict]) -> list[torch.Tensor]:
    model = load_hf(path)
    return [response_log_probs(model, s["tokens"], len(s["tokens"]) - s["response_length"]) for s in samples]


def test_tempered_checkpoint_divides_the_logits(tiny_qwen3, sharper_teacher):
    from transformers import AutoModelForCausalLM

    tokens = torch.tensor([[5, 9, 31, 7, 2]])
    with torch.no_grad():
        student = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)(tokens).logits
        teacher = AutoModelForCausalLM.from_pretrained(sharper_teacher, dtype=torch.float32)(tokens).logits
    assert torch.allclose(teacher, 4 * student, atol=1e-4)


@pytest.mark.parametrize("mode", ["reward", "loss"])
def test_opd_through_the_trainer(tiny_qwen3, sharper_teacher, mode):
    pytest.importorskip("megatron.core")
    from tests.helpers.trainer_runs import local_trainer

    samples = flat(make_rollout(seed=8))
    student_lp = _hf_log_probs(tiny_qwen3, samples)
    teacher_lp = _hf_log_probs(sharper_teacher, samples)
    groups = copy.deepcopy(make_rollout(seed=8))
    for s, lp in zip(flat(groups), student_lp):  # sampled by the student: its own log-probs
        s["rollout_log_probs"] = lp.tolist()
        if mode == "loss":  # no reward signal: the distillation term alone moves the student
            s["reward"] = 0.0
    tokens = sum(len(lp) for lp in student_lp)
    reverse_kl = sum((s - t).sum().item() for s, t in zip(student_lp, teacher_lp)) / tokens
    # k3 of the current policy against the teacher: exp(t - s) - (t - s) - 1, token mean
    k3 = sum((torch.exp(t - s) - (t - s) - 1).sum().item() for s, t in zip(student_lp, teacher_lp)) / tokens
    coef = 0.5
    # loss mode also keeps a KL reference: both swapped in for one rollout, the policy's weights put back after
    kl = ["--use-kl-loss", "--kl-loss-coef", "0.1"] if mode == "loss" else []
    with local_trainer(tiny_qwen3, "--opd-teacher-checkpoint", str(sharper_teacher), "--opd-mode", mode,
                       "--opd-coef", str(coef), "--global-batch-size", "16", *kl) as t:
        runs = [t.train(r, groups) for r in range(4)]
    first = runs[0]
    off_by = output_tolerance("logprob")  # the trainer's log-probs (student, teacher) against HF's on CPU
    assert reverse_kl > 0.05  # the sharper teacher is measurably far
    assert first["train/opd_reverse_kl"] == pytest.approx(reverse_kl, abs=off_by)
    if mode == "reward":  # on policy (ratio 1) the token-mean loss is minus the mean advantage, teacher's included
        assert first["train/pg_loss"] == pytest.approx(-first["train/advantage_mean"] + coef * reverse_kl, abs=off_by)
        assert "train/opd_kl_loss" not in first
    else:
        assert first["train/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the reference is the starting policy
        assert first["train/opd_kl_loss"] == pytest.approx(k3, abs=off_by)
        assert first["train/loss"] == pytest.approx(first["train/pg_loss"] + coef * k3, abs=off_by)
        # same samples each time: the student's own log-probs move toward the teacher's
        assert runs[-1]["train/opd_kl_loss"] < 0.9 * k3, [r["train/opd_kl_loss"] for r in runs]
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in runs)
