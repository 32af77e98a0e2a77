"""Rollout correction against hand-computed references: TIS and MIS at token, sequence and geometric-mean level,
ICE-POP, AReaL's decoupled objective, bypass (--use-rollout-logprobs) and a custom TIS function with slime's
signature, through the trainer's loss (vime/trainer/micro_batch_loss.py) with the log-probs given.

Two samples, eps_clip 0.2, probabilities (current pi / old = proximal / engine = behaviour):
  A (advantage +1): pi [0.5, 0.3]        old [0.4, 0.3]        engine [0.2, 0.6]
  B (advantage -1): pi [0.1, 0.5, 0.9]   old [0.2, 0.5, 0.5]   engine [0.25, 0.25, 0.01], third token mask 0
PPO on pi / old: A r [1.25, 1.0] -> losses [-1.2, -1.0]; B r [0.5, 1.0] -> [0.8, 1.0].
Token weights old / engine: A [2.0, 0.5], B [0.8, 2.0]; sequence products A 1.0, B 1.6; geometric A 1.0,
B sqrt(1.6). Every aggregate is a token mean over the 4 trainable tokens.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vime.algorithms.rollout_correction import compute_mis_weights, correction_log_ratios, truncated_weights
from vime.arguments import parse_args

L = math.log
PI = [[0.5, 0.3], [0.1, 0.5, 0.9]]
OLD = [[0.4, 0.3], [0.2, 0.5, 0.5]]
ENGINE = [[0.2, 0.6], [0.25, 0.25, 0.01]]
MASKS = [[1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [[1.0, 1.0], [-1.0, -1.0, -1.0]]


def logs(probs):
    return [torch.tensor([L(p) for p in seq]) for seq in probs]


def masks():
    return [torch.tensor(m) for m in MASKS]


def test_levels_by_hand():
    lr = correction_log_ratios(logs(OLD), logs(ENGINE), masks(), "token")
    torch.testing.assert_close(lr.exp(), torch.tensor([2.0, 0.5, 0.8, 2.0, 1.0]))  # mask-0 token: log w 0
    seq = correction_log_ratios(logs(OLD), logs(ENGINE), masks(), "sequence").exp()
    torch.testing.assert_close(seq, torch.tensor([1.0, 1.0, 1.6, 1.6, 1.6]))
    geo = correction_log_ratios(logs(OLD), logs(ENGINE), masks(), "geometric").exp()
    torch.testing.assert_close(geo, torch.tensor([1.0, 1.0] + [math.sqrt(1.6)] * 3))

    weights, truncated = truncated_weights(logs(OLD), logs(ENGINE), masks(), "sequence", 0.0, 1.5)
    torch.testing.assert_close(torch.cat(weights), torch.tensor([1.0, 1.0, 1.5, 1.5, 1.5]))
    assert torch.cat(truncated).tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    weights, keep = compute_mis_weights(logs(OLD), logs(ENGINE), masks(), "geometric", 0.5, 1.2)
    assert torch.cat(keep).tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]  # B rejected; its mask-0 token never is
    torch.testing.assert_close(torch.cat(weights)[:4], torch.tensor([1.0, 1.0, 0.0, 0.0]))


def custom_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
               **kwargs):
    """A slime-style correction: doubles the loss and drops each sample's second token."""
    assert pg_loss.dim() == 1 and pg_loss.numel() == 5 and response_lengths == [2, 3]
    assert total_lengths == [4, 6] and len(train_log_probs) == len(rollout_log_probs) == 2
    torch.testing.assert_close(train_log_probs[0].exp(), torch.tensor(OLD[0]))  # the old (proximal) policy
    keep = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0, 1.0])]
    return pg_loss * 2.0, [m * k for m, k in zip(loss_masks, keep)], {"my_weight": torch.full_like(pg_loss, 2.0)}


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # the flags are parsed without reading the model
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    return str(tmp_path)


def _loss(monkeypatch, checkpoint, *flags, old_given=True):
    from vime.trainer import micro_batch_loss as loss_module
    from vime.trainer.train_batch import TrainBatch

    args = parse_args(["--hf-checkpoint", checkpoint, "--prompt-data", f"{checkpoint}/prompts.jsonl", "--rm-type", "math", "--eps-clip", "0.2", *flags], check_model=False)
    pi = [lp.clone().requires_grad_() for lp in logs(PI)]
    monkeypatch.setattr(loss_module, "response_log_probs",
                        lambda *a, **k: (pi, [torch.zeros(len(p)) for p in PI]))
    batch = TrainBatch(tokens=[[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]], response_lengths=[2, 3], loss_masks=masks(),
                       rollout_log_probs=logs(ENGINE), old_log_probs=logs(OLD) if old_given else None,
                       advantages=[torch.tensor(a) for a in ADV])
    loss_fn = loss_module.make_loss_fn(args, batch, {"tokens": 4.0, "sequences": 2}, scale=1.0, step_index=1)
    loss, metrics = loss_fn([0, 1], SimpleNamespace(targets=None, response_lengths=[2, 3]), None)
    return loss.item(), {k: float(v) for k, v in metrics.items()}


CASES = {
    # token TIS, cap 1.5 (AReaL's decoupled objective): A [-1.2*1.5, -1.0*0.5], B [0.8*0.8, 1.0*1.5]
    "decoupled": (("--use-tis", "--tis-clip", "1.5"), (-1.8 - 0.5 + 0.64 + 1.5) / 4,
                  {"tis_clipfrac": 0.5, "tis_weight_mean": (1.5 + 0.5 + 0.8 + 1.5) / 4}),
    "sequence TIS": (("--use-tis", "--tis-clip", "1.5", "--tis-level", "sequence"),
                     (-1.2 - 1.0 + (0.8 + 1.0) * 1.5) / 4, {"tis_clipfrac": 0.5}),
    "geometric TIS": (("--use-tis", "--tis-clip", "1.5", "--tis-level", "geometric"),
                      (-1.2 - 1.0 + (0.8 + 1.0) * math.sqrt(1.6)) / 4, {"tis_clipfrac": 0.0}),
    # ICE-POP: token MIS in [0.5, 1.9]: A's first token (2.0) and B's second (2.0) get no gradient
    "ICE-POP": (("--use-mis", "--mis-threshold-low", "0.5", "--mis-threshold-high", "1.9"),
                (-1.0 * 0.5 + 0.8 * 0.8) / 4, {"mis_masked_fraction": 0.5}),
    "geometric MIS": (("--use-mis", "--mis-level", "geometric", "--mis-threshold-low", "0.5",
                       "--mis-threshold-high", "1.2"), (-1.2 - 1.0) / 4, {"mis_masked_fraction": 0.5}),
    # bypass: PPO on pi / engine: A r [2.5, 0.5] -> [-1.2, -0.5]; B r [0.4, 2.0] -> [0.8, 2.0]
    "bypass": (("--use-rollout-logprobs",), (-1.2 - 0.5 + 0.8 + 2.0) / 4, {}),
    # custom: doubled, second tokens dropped: A -1.2 * 2, B 0.8 * 2
    "custom": (("--use-tis", "--custom-tis-function-path", f"{__name__}.custom_tis"), (-2.4 + 1.6) / 4,
               {"my_weight": 2.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_by_hand(case, monkeypatch, checkpoint):
    flags, expected, expected_metrics = CASES[case]
    loss, metrics = _loss(monkeypatch, checkpoint, *flags)
    assert loss == pytest.approx(expected, abs=1e-5)
    for name, value in expected_metrics.items():
        assert metrics[name] == pytest.approx(value, abs=1e-5), name


def test_bypass_needs_no_trainer_old_log_probs(monkeypatch, checkpoint):
    assert _loss(monkeypatch, checkpoint, "--use-rollout-logprobs", old_given=False)[0] == pytest.approx(0.275, abs=1e-5)


@pytest.mark.parametrize("flags, message", [
    (("--use-rollout-logprobs", "--use-tis"), "every TIS / MIS weight would be exactly 1"),
    (("--custom-tis-function-path", f"{__name__}.custom_tis"), "add --use-tis"),
])
def test_bad_combinations_are_refused(flags, message, capsys, checkpoint):
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", checkpoint, "--prompt-data", f"{checkpoint}/prompts.jsonl", "--rm-type", "math", *flags], check_model=False)
    assert message in capsys.readouterr().err


def test_bypass_skips_the_trainers_old_log_prob_pass_on_real_megatron(tiny_qwen3, monkeypatch):
    """Two optimizer steps per rollout need an old policy fixed before the first: the trainer computes it with a
    forward pass over the rollout, unless the engine's log-probs are the old policy."""
    from tests.helpers.rollouts import make_rollout
    from tests.helpers.trainer_runs import local_trainer
    from vime.trainer import trainer as trainer_module

    groups = make_rollout(seed=3)
    for sample in (s for g in groups for s in g):
        sample["rollout_log_probs"] = [-3.0] * sample["response_length"]
    passes = []
    real = trainer_module.forward_log_probs
    monkeypatch.setattr(trainer_module, "forward_log_probs", lambda *a, **k: passes.append(1) or real(*a, **k))
    for flags, expected_passes in (((), 1), (("--use-rollout-logprobs",), 0)):
        passes.clear()
        with local_trainer(tiny_qwen3, "--global-batch-size", "8", *flags) as t:
            metrics = t.train(0, groups)
        assert len(passes) == expected_passes, flags
        assert metrics["train/skipped_steps"] == 0 and metrics["train/grad_norm"] > 0


def test_the_loss_takes_the_rollouts_entropy_coefficient(monkeypatch, checkpoint):
    """The entropy bonus uses the coefficient the trainer hands the loss for this rollout (--entropy-coef-schedule),
    not the flag's: entropies A [0.5, 1.0], B [2.0, 0.0, (mask 0) 9.0] -> token mean 3.5 / 4; with no coefficient
    given the flag's (0.3) applies."""
    from vime.trainer import micro_batch_loss as loss_module
    from vime.trainer.train_batch import TrainBatch

    args = parse_args(["--hf-checkpoint", checkpoint, "--prompt-data", f"{checkpoint}/prompts.jsonl", "--rm-type",
                       "math", "--eps-clip", "0.2", "--entropy-coef", "0.3"], check_model=False)
    entropy = [torch.tensor([0.5, 1.0]), torch.tensor([2.0, 0.0, 9.0])]
    monkeypatch.setattr(loss_module, "response_log_probs", lambda *a, **k: (
        [lp.clone().requires_grad_() for lp in logs(PI)], entropy))
    batch = TrainBatch(tokens=[[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]], response_lengths=[2, 3], loss_masks=masks(),
                       old_log_probs=logs(OLD), advantages=[torch.tensor(a) for a in ADV])

    def loss(**coefficient):
        loss_fn = loss_module.make_loss_fn(args, batch, {"tokens": 4.0, "sequences": 2}, scale=1.0, step_index=1,
                                           **coefficient)
        return loss_fn([0, 1], SimpleNamespace(targets=None, response_lengths=[2, 3]), None)[0].item()

    pg = (-1.2 - 1.0 + 0.8 + 1.0) / 4  # the module docstring's PPO losses
    assert loss(entropy_coef=0.0) == pytest.approx(pg)
    assert loss(entropy_coef=0.1) == pytest.approx(pg - 0.1 * 3.5 / 4)
    assert loss() == pytest.approx(pg - 0.3 * 3.5 / 4)
