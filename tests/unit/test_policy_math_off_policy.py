"""The RL math of vime's real training step, off policy, recomputed by hand: Megatron-core's trainer (gloo, this
CPU) takes two optimizer steps per rollout with a large learning rate, so the second step's samples see ratios
pi_theta / pi_old well away from 1, and the rollout's engine log-probs differ from the trainer's (importance
weights away from 1). Every micro-batch's loss inputs and outputs are captured around the trainer's own loss
function (`trainer.make_loss_fn`), and the test recomputes, from the batch and the captured log-probs alone, in
plain Python from the papers' formulas:

- GRPO's group-normalised advantages; PPO's clipped surrogate with clip-higher and dual clip; the KL loss (k2)
  against the reference; TIS's truncated weights; the clip fraction;
- GSPO's sequence-level ratio (one per sample: the mean log-ratio over its trainable tokens); MIS's rejection;
- CISPO's clipped, detached importance weight on -A * log pi;
- REINFORCE++'s discounted return with the KL penalty in the reward, whitened over the batch, on a second rollout
  (where the policy has left the reference) and with a masked span (tool output) the discount skips.

Each breaks when its math does: `scripts/mutation_check.sh` mutates the code and shows these tests catch it.
"""

from __future__ import annotations

import math

import pytest
import torch

from vime.arguments import parse_args
from vime.data.sample import Sample
from vime.synthetic.tiny_model import build_tiny_model
from vime.trainer.megatron.parallel import destroy_parallel

TOL = 2e-5
GROUP = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("offpolicy") / "qwen3", arch="qwen3", seed=0)


def _rollout(seed: int, masked_span: bool = False) -> list[list[dict]]:
    """2 prompts x 4 samples with unequal rewards and lengths, engine log-probs far from the trainer's (an
    off-policy engine: weights between 0.05 and 20 before truncation); one sample with a masked span."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for p in range(2):
        prompt = torch.randint(5, 500, (12,), generator=g).tolist()
        samples = []
        for k in range(GROUP):
            n = 10 + 3 * k
            mask = [1] * n
            if masked_span and p == 0 and k == 1:
                mask[3:6] = [0, 0, 0]  # tool output inside the response: not trained, not discounted over
            samples.append(Sample(
                group_index=p, index=p * GROUP + k, response_length=n, loss_mask=mask,
                tokens=prompt + torch.randint(5, 500, (n,), generator=g).tolist(),
                rollout_log_probs=(-6.5 + 6.0 * torch.rand(n, generator=g)).tolist(),
                reward=[1.0, 0.0, 0.5, 0.25][(k + p) % 4], status=Sample.Status.COMPLETED).to_dict())
        groups.append(samples)
    return groups


def _capture(monkeypatch) -> list[dict]:
    """Each optimizer step's batch and denominators, and per micro-batch its sample indices, the log-probs its
    forward computed (detached) and the metrics the trainer's loss function reported (its shares of the step)."""
    from vime.trainer import trainer as trainer_module
    from vime.trainer.log_probs import response_log_probs

    steps: list[dict] = []
    build = trainer_module.make_loss_fn

    def make_loss_fn(args, batch, denominators, scale, step_index, **kwargs):
        loss_fn = build(args, batch, denominators, scale, step_index, **kwargs)
        record = {"step": step_index, "batch": batch, "tokens": float(denominators["tokens"]), "mbs": []}
        steps.append(record)

        def captured(indices, inputs, logits):
            log_probs, _ = response_log_probs(logits.detach(), inputs.targets, inputs.response_lengths, 1.0)
            loss, metrics = loss_fn(indices, inputs, logits)
            record["mbs"].append((list(indices), [lp.clone() for lp in log_probs],
                                  {k: float(v) for k, v in metrics.items()}))
            return loss, metrics

        return captured

    monkeypatch.setattr(trainer_module, "make_loss_fn", make_loss_fn)
    return steps


def _train(checkpoint, flags: list[str], rollouts: list) -> tuple[list[dict], list[dict], object]:
    from vime.trainer.trainer import MegatronTrainer

    argv = ["--hf-checkpoint", str(checkpoint), "--debug-train-only", "--load-debug-rollout-data", "unused_{rollout_id}.jsonl",
            "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", str(GROUP),
            "--micro-batch-size", "2", "--num-steps-per-rollout", "2", "--lr", "0.05", "--clip-grad", "0",
            "--no-share-group-prompts", *flags]
    trainer = MegatronTrainer(parse_args(argv))
    try:
        return [trainer.train(i, data) for i, data in enumerate(rollouts)], trainer
    finally:
        destroy_parallel()


# ---- the papers' formulas, per token, in plain Python ----------------------------------------------------------

def group_normalised(rewards: list[float]) -> list[float]:
    """GRPO: (r - mean of the group) / (the group's sample std + 1e-6)."""
    out = []
    for g in range(0, len(rewards), GROUP):
        group = rewards[g:g + GROUP]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + 1e-6) for r in group]
    return out


def clipped_surrogate(ratio: float, adv: float, eps: float, eps_high: float, dual: float | None):
    """PPO with clip-higher, and Ye et al.'s dual clip for negative advantages: (loss, clipped)."""
    plain, clipped = -adv * ratio, -adv * min(max(ratio, 1 - eps), 1 + eps_high)
    loss, was_clipped = max(plain, clipped), clipped > plain
    if dual is not None and adv < 0 and -adv * dual < loss:
        loss, was_clipped = -adv * dual, True
    return loss, was_clipped


def _per_step(steps: list[dict]):
    """Per step: (sample indices, {index: current log-probs}) from its micro-batches."""
    for record in steps:
        current = {i: lp for indices, lps, _ in record["mbs"] for i, lp in zip(indices, lps)}
        yield record, current


def _reported(record: dict, name: str) -> float:
    return sum(metrics[name] for _, _, metrics in record["mbs"])


def _masks(batch) -> dict[int, list[float]]:
    return {i: m.tolist() for i, m in enumerate(batch.loss_masks)}


def _check_off_policy(record: dict, current: dict) -> None:
    """The rollout's first step runs under the old weights (its log-probs are the old ones); the second does not."""
    old = record["batch"].old_log_probs
    gaps = [float((current[i] - old[i]).abs().max()) for i in current]
    if record["step"] == 0:
        assert max(gaps) < TOL, gaps
    else:
        assert max(gaps) > 0.05, f"the second step is on policy after all: {gaps}"


def test_grpo_ppo_clip_higher_dual_clip_tis_and_kl_loss(checkpoint, monkeypatch):
    eps, eps_high, dual, kl_coef, tis_clip = 0.1, 0.3, 1.5, 0.5, 2.0
    steps = _capture(monkeypatch)
    (metrics,), _ = _train(checkpoint, ["--eps-clip", str(eps), "--eps-clip-high", str(eps_high), "--eps-clip-c",
                                        str(dual), "--use-kl-loss", "--kl-loss-coef", str(kl_coef), "--kl-loss-type",
                                        "k2", "--use-tis", "--tis-clip", str(tis_clip)], [_rollout(1)])
    batch = steps[0]["batch"]
    rewards = [float(r) for r in batch.rewards]
    advantages = group_normalised(rewards)
    for i, a in enumerate(batch.advantages):
        assert a.tolist() == pytest.approx([advantages[i]] * len(a), abs=TOL), i
    clipped_any, losses = 0.0, []
    for record, current in _per_step(steps):
        _check_off_policy(record, current)
        masks, old, ref = _masks(batch), batch.old_log_probs, batch.ref_log_probs
        pg = kl = clip = tis = 0.0
        for i, lp in current.items():
            for t, m in enumerate(masks[i]):
                ratio = math.exp(float(lp[t]) - float(old[i][t]))
                weight = min(math.exp(float(old[i][t]) - float(batch.rollout_log_probs[i][t])), tis_clip)
                loss, was_clipped = clipped_surrogate(ratio, advantages[i], eps, eps_high, dual)
                pg += m * weight * loss
                clip += m * was_clipped
                tis += m * weight
                kl += m * 0.5 * (float(lp[t]) - float(ref[i][t])) ** 2
        n = record["tokens"]
        assert _reported(record, "pg_loss") == pytest.approx(pg / n, abs=TOL)
        assert _reported(record, "pg_clipfrac") == pytest.approx(clip / n, abs=TOL)
        assert _reported(record, "tis_weight_mean") == pytest.approx(tis / n, abs=TOL)
        assert _reported(record, "kl_loss") == pytest.approx(kl / n, abs=TOL)
        assert _reported(record, "loss") == pytest.approx((pg + kl_coef * kl) / n, abs=TOL)
        clipped_any += clip
        losses.append(pg / n)
    assert clipped_any > 0, "no token was clipped: the test would not see the clip break"
    assert metrics["train/pg_loss"] == pytest.approx(sum(losses) / 2, abs=TOL)  # the rollout's: the steps' mean


def test_gspo_sequence_ratio_with_mis(checkpoint, monkeypatch):
    eps, low, high = 0.05, 0.5, 2.0
    steps = _capture(monkeypatch)
    _train(checkpoint, ["--advantage-estimator", "gspo", "--policy-loss", "gspo", "--eps-clip", str(eps),
                        "--use-mis", "--mis-threshold-low", str(low), "--mis-threshold-high", str(high)], [_rollout(2)])
    batch = steps[0]["batch"]
    advantages = group_normalised([float(r) for r in batch.rewards])
    rejected_any = 0.0
    for record, current in _per_step(steps):
        _check_off_policy(record, current)
        masks, old = _masks(batch), batch.old_log_probs
        pg = clip = rejected = 0.0
        for i, lp in current.items():
            trained = [t for t, m in enumerate(masks[i]) if m]
            ratio = math.exp(sum(float(lp[t]) - float(old[i][t]) for t in trained) / len(trained))  # per sequence
            loss, was_clipped = clipped_surrogate(ratio, advantages[i], eps, eps, None)
            for t in trained:
                weight = math.exp(float(old[i][t]) - float(batch.rollout_log_probs[i][t]))
                kept = low <= weight <= high
                pg += loss * weight if kept else 0.0
                rejected += not kept
                clip += was_clipped
        n = record["tokens"]
        assert _reported(record, "pg_loss") == pytest.approx(pg / n, abs=TOL)
        assert _reported(record, "pg_clipfrac") == pytest.approx(clip / n, abs=TOL)
        assert _reported(record, "mis_masked_fraction") == pytest.approx(rejected / n, abs=TOL)
        rejected_any += rejected
    assert rejected_any > 0


def test_cispo_clipped_detached_weight(checkpoint, monkeypatch):
    eps_high = 0.02
    steps = _capture(monkeypatch)
    _train(checkpoint, ["--advantage-estimator", "cispo", "--policy-loss", "cispo", "--eps-clip-high",
                        str(eps_high)], [_rollout(3)])
    batch = steps[0]["batch"]
    advantages = group_normalised([float(r) for r in batch.rewards])
    clipped_any = 0.0
    for record, current in _per_step(steps):
        _check_off_policy(record, current)
        masks, old = _masks(batch), batch.old_log_probs
        pg = clip = 0.0
        for i, lp in current.items():
            for t, m in enumerate(masks[i]):
                ratio = math.exp(float(lp[t]) - float(old[i][t]))
                weight = min(ratio, 1 + eps_high)  # no lower bound: the paper's setting
                pg += m * -weight * advantages[i] * float(lp[t])
                clip += m * (weight != ratio)
        n = record["tokens"]
        assert _reported(record, "pg_loss") == pytest.approx(pg / n, abs=TOL)
        assert _reported(record, "pg_clipfrac") == pytest.approx(clip / n, abs=TOL)
        clipped_any += clip
    assert clipped_any > 0


def test_reinforce_plus_plus_discounted_return_with_kl_in_the_reward(checkpoint, monkeypatch):
    """Two rollouts: on the second the policy has left the reference, so the per-token KL penalty is not 0."""
    gamma, kl_coef = 0.9, 0.2
    steps = _capture(monkeypatch)
    _train(checkpoint, ["--advantage-estimator", "reinforce_plus_plus", "--gamma", str(gamma), "--kl-coef",
                        str(kl_coef)], [_rollout(4, masked_span=True), _rollout(5, masked_span=True)])
    batch = steps[-1]["batch"]  # the second rollout's
    old, ref, masks = batch.old_log_probs, batch.ref_log_probs, _masks(batch)
    assert max(float((o - r).abs().max()) for o, r in zip(old, ref)) > 0.05  # the KL term is really there
    returns = []
    for i, mask in masks.items():
        trained = [t for t, m in enumerate(mask) if m]
        reward = [-kl_coef * (float(old[i][t]) - float(ref[i][t])) for t in trained]  # k1
        reward[-1] += float(batch.rewards[i])
        running, values = 0.0, {}
        for t, r in zip(reversed(trained), reversed(reward)):  # a masked span costs no discount step
            running = r + gamma * running
            values[t] = running
        returns.append(values)
    flat = [v for values in returns for v in values.values()]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / len(flat) + 1e-6)
    for i, a in enumerate(batch.advantages):
        expected = [(returns[i][t] - mean) / std if t in returns[i] else 0.0 for t in range(len(a))]
        assert a.tolist() == pytest.approx(expected, abs=TOL), i


def test_the_mutation_checks_targets_are_in_the_code():
    """scripts/mutation_check.sh mutates exact lines of the code; a refactoring that moves one must update it."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "mutation_check.sh"
    proc = subprocess.run(["bash", str(script), "--targets"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "mutation targets found" in proc.stdout, proc.stdout + proc.stderr
