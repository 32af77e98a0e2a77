"""The PPO critic on real Megatron-core: a value head replaces the LM head, starts at zero, regresses onto the
returns; the actor's GAE advantages use its values."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers.devices import output_tolerance
from tests.helpers.rollouts import flat, make_rollout
from tests.helpers.trainer_runs import BASE_ARGV


@contextlib.contextmanager
def critic(hf_dir, *extra, role: str = "critic"):
    """A PPO run's critic (or, with `role="actor"`, its actor) in this process."""
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer
    from vime.arguments import parse_args

    args = parse_args(["--hf-checkpoint", str(hf_dir), *BASE_ARGV, "--advantage-estimator", "ppo", *extra])
    assert args.use_critic
    try:
        yield MegatronTrainer(args, role=role)
    finally:
        destroy_parallel()


def test_values_start_at_zero_and_regress_onto_returns(tiny_qwen3):
    groups = make_rollout(seed=5)
    samples = flat(groups)
    with critic(tiny_qwen3, "--lr", "2e-3", "--value-clip", "1000") as c:
        values = c.compute_values(groups)
        assert sorted(values) == list(range(len(samples)))
        assert all(len(values[i]) == s["response_length"] for i, s in enumerate(samples))
        assert all(v == 0.0 for vs in values.values() for v in vs)  # zero-initialised head
        returns = [[float(s["reward"])] * s["response_length"] for s in samples]
        losses = []
        for r in range(8):
            values = c.compute_values(groups)
            metrics = c.train_critic(r, groups, values, returns)
            losses.append(metrics["critic/value_loss"])
        # 0.5 * mean((0 - R)^2) over tokens at the start: with R in {0, 1} that is half the rewarded share
        tokens = sum(s["response_length"] for s in samples)
        rewarded = sum(s["response_length"] for s in samples if s["reward"] > 0)
        assert losses[0] == pytest.approx(0.5 * rewarded / tokens, abs=1e-6)
        assert losses[-1] < 0.5 * losses[0], losses
        final = c.compute_values(groups)
    good = torch.tensor([sum(final[i]) / len(final[i]) for i, s in enumerate(samples) if s["reward"] > 0]).mean()
    bad = torch.tensor([sum(final[i]) / len(final[i]) for i, s in enumerate(samples) if s["reward"] == 0]).mean()
    assert good > bad + 0.2


def test_value_clip_limits_the_update(tiny_qwen3):
    groups = make_rollout(seed=6)
    samples = flat(groups)
    returns = [[5.0] * s["response_length"] for s in samples]
    with critic(tiny_qwen3, "--lr", "1e-2", "--value-clip", "0.01") as c:
        zeros = c.compute_values(groups)
        first = c.train_critic(0, groups, zeros, returns)
        # v == v_old on the first step: 0.5 * 5^2 on every token, nothing clipped
        assert first["critic/value_loss"] == pytest.approx(0.5 * 25.0, rel=1e-3)
        assert first["critic/value_clipfrac"] == 0.0
        moved = c.compute_values(groups)
        shift = max(abs(v) for vs in moved.values() for v in vs)
        assert shift > 0.01
        # against the old (zero) values, the values now sit outside +-0.01: the clipped term decides
        second = c.train_critic(1, groups, zeros, returns)
    assert second["critic/value_clipfrac"] > 0.5


def test_a_kill_between_the_actor_and_critic_saves_resumes_both_from_the_published_checkpoint(tiny_qwen3, tmp_path):
    """A run saves the actor's part of a checkpoint, then the critic's, then publishes both under one marker
    (`session.maybe_save`, `publish_checkpoint`). Rollout 0's checkpoint is published; of rollout 1's only the
    actor's part was written when the run died. A resume loads rollout 0's actor and critic: never a pair from two
    different rollouts."""
    from vime.trainer.megatron.checkpoint_files import publish, resolve_checkpoint

    groups = make_rollout(seed=7)
    returns = [[float(s["reward"])] * s["response_length"] for s in flat(groups)]
    save = str(tmp_path / "ckpt")
    with critic(tiny_qwen3, "--save", save, role="actor") as actor:
        actor.save(0, {})
    with critic(tiny_qwen3, "--lr", "2e-3", "--save", save) as c:
        c.train_critic(0, groups, c.compute_values(groups), returns)
        saved = c.compute_values(groups)
        c.save(0, {})
        publish(save, 0, parts=["actor", "critic"])
        c.train_critic(1, groups, saved, returns)  # trained on, never saved: the run dies first
    with critic(tiny_qwen3, "--save", save, role="actor") as actor:
        actor.save(1, {})
    assert (tmp_path / "ckpt" / "iter_0000001.partial").is_dir() and resolve_checkpoint(save).name == "iter_0000000"

    with critic(tiny_qwen3, "--lr", "2e-3", "--load", save) as c:
        assert c.get_loaded_state()["rollout_id"] == 0
        resumed = c.compute_values(groups)
    assert any(v != 0.0 for vs in saved.values() for v in vs)  # a trained head, not a fresh (zero) one
    assert resumed.keys() == saved.keys()
    # per-token outputs of another trainer (kind "logprob"): its kernels need not round alike on a GPU
    assert max(abs(a - b) for i in saved for a, b in zip(saved[i], resumed[i])) < output_tolerance("logprob", cpu=1e-6)
    with critic(tiny_qwen3, "--load", save, role="actor") as actor:  # saved before any step: Adam as fresh
        assert actor.get_loaded_state()["rollout_id"] == 0
        states = [s for opt in actor.optimizer.chained_optimizers for s in opt.optimizer.state.values()]
        assert states and all(float(s["step"]) == 0.0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
                              for s in states)
