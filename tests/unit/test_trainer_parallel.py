"""MegatronTrainer on 2 CPU processes (gloo): DP=2, TP=2 and PP=2 train like one process.

Same data, same global batch (16 samples, one optimizer step per rollout), micro-batches of 2 per rank. The
loss includes an entropy bonus so that it depends on the weights (the on-policy GRPO surrogate alone does
not); rollout 1 then checks that the first optimizer step moved every layout's weights alike.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance  # noqa: E402
from tests.helpers.rollouts import make_rollout  # noqa: E402
from tests.helpers.trainer_runs import BASE_ARGV, launch, local_trainer  # noqa: E402

EXTRA_ARGV = ["--entropy-coef", "0.01"]
KEYS = ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm")


@pytest.fixture(scope="module")
def data():
    return {str(r): make_rollout(seed=20 + r) for r in range(2)}


@pytest.fixture(scope="module")
def one_process(tiny_qwen3, data):
    with local_trainer(tiny_qwen3, *EXTRA_ARGV) as t:
        return [t.train(r, data[str(r)]) for r in range(2)]


@pytest.mark.parametrize("layout, reporting_ranks", [
    (["--tensor-model-parallel-size", "1"], [0, 1]),  # DP=2: every rank is a last-stage TP-rank 0
    (["--tensor-model-parallel-size", "2"], [0]),
    (["--pipeline-model-parallel-size", "2"], [1]),
], ids=["dp2", "tp2", "pp2"])
def test_two_processes_train_like_one(tiny_qwen3, data, one_process, tmp_path, layout, reporting_ranks):
    argv = ["--hf-checkpoint", str(tiny_qwen3), *BASE_ARGV, *EXTRA_ARGV, *layout]
    reports = launch({"argv": argv, "data": data, "train": [0, 1]}, tmp_path, world_size=2, timeout_s=120)
    for rank, report in enumerate(reports):
        metrics = report["metrics"]
        if rank not in reporting_ranks:
            assert metrics == {"0": {}, "1": {}}
            continue
        for r, expected in enumerate(one_process):
            got = metrics[str(r)]
            assert got["train/steps"] == 1 and got["train/num_usable_samples"] == 16
            for key in KEYS:
                assert got[key] == pytest.approx(expected[key], abs=output_tolerance("loss", cpu=1e-5)), (rank, r, key)
