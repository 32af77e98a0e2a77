"""--offload-train on real Megatron-core: offloading frees every storage the rank holds between rollouts, and
onloading restores them in place, so training continues exactly as if nothing had moved."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.rollouts import make_rollout  # noqa: E402
from tests.helpers.trainer_runs import local_trainer as trainer  # noqa: E402
from vime.trainer.offload import TrainStateOffloader, train_state_tensors  # noqa: E402

EXTRA = ("--use-kl-loss", "--kl-loss-coef", "0.1")  # a KL reference snapshot is part of the state too


def _run(hf_dir, offload: bool) -> tuple[list[dict], list[float]]:
    groups = [make_rollout(seed=s) for s in range(3)]
    with trainer(hf_dir, *EXTRA) as t:
        metrics = []
        for rollout_id, g in enumerate(groups):
            metrics.append(t.train(rollout_id, g))
            if offload:
                model_bytes = sum(p.numel() * p.element_size() for m in t.model for p in m.module.parameters())
                moved = t.offload()
                # params + grads + Adam moments + reference: several times the parameter bytes
                assert moved >= 4 * model_bytes
                held = {id(x.untyped_storage()): x.untyped_storage().nbytes()
                        for x in train_state_tensors(t.model, t.optimizer)}
                assert set(held.values()) == {0}, "some training state stayed on the device"
                assert t.offload() == 0  # idempotent until onload
                assert t.onload() == moved
        s = groups[0][0][0]
        return metrics, t.probe_log_probs(s["tokens"], s["response_length"])


def test_offload_onload_round_trip_keeps_training_identical(tiny_qwen3):
    plain, plain_probe = _run(tiny_qwen3, offload=False)
    moved, moved_probe = _run(tiny_qwen3, offload=True)
    for a, b in zip(plain, moved):
        for key in ("train/loss", "train/kl_loss", "train/grad_norm"):
            assert b[key] == a[key], key  # bit-identical: the same bytes came back
    assert moved_probe == plain_probe


def test_views_follow_their_storage():
    base = torch.arange(12, dtype=torch.float32)
    view = base[4:8].view(2, 2)
    off = TrainStateOffloader()
    assert off.offload([view, base]) == 48  # one storage, counted once
    assert base.untyped_storage().nbytes() == 0
    off.onload()
    assert view.tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert off.offload([]) == 0 and not off.offloaded
