"""Activation recompute and sequence parallel on the real megatron-core trainer on CPU: neither changes the math.

Recompute (full uniform, full block, selective) replays each checkpointed forward in the backward pass; one
training step must give the same loss and the same gradients as without. Sequence parallel with TP 2 (two gloo
ranks) splits the sequence dimension over the ranks; it must train like one process: same loss, same updated
weights. The --recompute-* / --sequence-parallel values are set on the parsed args, as their flags would.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance, trained_weights_tolerance  # noqa: E402
from tests.helpers.rollouts import make_rollout  # noqa: E402
from tests.helpers.trainer_runs import BASE_ARGV, launch  # noqa: E402
from vime.trainer.batching import micro_batch_inputs  # noqa: E402

EXTRA_ARGV = ["--entropy-coef", "0.01"]  # the loss then depends on the weights


def train_one_step(hf_dir, groups, **values):
    """(metrics, {param name: gradient}, number of recomputed forwards) of one step of a fresh one-process
    trainer whose parsed args carry `values`."""
    import megatron.core.tensor_parallel.random as mcore_random

    from vime.arguments import parse_args
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer
    from vime.utils.misc import with_values

    args = with_values(parse_args(["--hf-checkpoint", str(hf_dir), *BASE_ARGV, *EXTRA_ARGV]), **values)
    replays = []
    restore = mcore_random._set_all_rng_states  # called only where a checkpointed forward is recomputed
    mcore_random._set_all_rng_states = lambda *a: (replays.append(1), restore(*a))[1]
    try:
        trainer = MegatronTrainer(args)
        metrics = trainer.train(0, groups)
        grads = {name: p.main_grad.detach().clone() for chunk in trainer.model
                 for name, p in chunk.module.named_parameters()}
    finally:
        mcore_random._set_all_rng_states = restore
        destroy_parallel()
    return metrics, grads, len(replays)


@pytest.fixture(scope="module")
def groups():
    return make_rollout(seed=20)


@pytest.fixture(scope="module")
def without_recompute(tiny_qwen3, groups):
    return train_one_step(tiny_qwen3, groups)


@pytest.mark.parametrize("values", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),  # core attention
    dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]),
], ids=["full-uniform", "full-block", "selective", "selective-mlp-layernorm"])
def test_activation_recompute_gives_the_same_loss_and_gradients(tiny_qwen3, groups, without_recompute, values):
    metrics, grads, replays = train_one_step(tiny_qwen3, groups, **values)
    expected_metrics, expected_grads, no_replays = without_recompute
    assert no_replays == 0 and replays > 0, (no_replays, replays)
    assert metrics["train/steps"] == 1
    assert metrics["train/loss"] == pytest.approx(expected_metrics["train/loss"], abs=output_tolerance("loss"))
    assert grads.keys() == expected_grads.keys()
    assert any(g.abs().max() > 0 for g in grads.values())
    worst = max((grads[n] - expected_grads[n]).abs().max().item() for n in grads)
    assert worst <= output_tolerance("grad"), worst


@pytest.mark.parametrize("packed", [True, False], ids=["thd", "bshd"])
def test_sequence_parallel_pads_the_sequence_to_a_multiple_of_tp(packed):
    tokens, response_lengths = [[5, 6, 7, 8], [9, 10, 11]], [2, 1]
    plain = micro_batch_inputs(tokens, response_lengths, packed=packed)
    padded = micro_batch_inputs(tokens, response_lengths, packed=packed, multiple=4)
    assert padded.tokens.shape[-1] == 8 if packed else padded.tokens.shape == (2, 4)
    assert torch.equal(padded.logit_rows, plain.logit_rows) and torch.equal(padded.targets, plain.targets)
    if packed:  # the padding is a sequence of its own, attending only to itself
        assert padded.cu_seqlens.tolist() == [0, 4, 7, 8] and padded.positions[0, -1] == 0


def test_sequence_parallel_with_tp2_trains_like_one_process(tiny_qwen3, tmp_path):
    data = {str(r): make_rollout(seed=20 + r) for r in range(2)}
    base = ["--hf-checkpoint", str(tiny_qwen3), *BASE_ARGV, *EXTRA_ARGV]
    one = launch({"argv": base, "data": data, "train": [0, 1], "weights": True}, tmp_path / "tp1")
    two = launch({"argv": [*base, "--tensor-model-parallel-size", "2"], "data": data, "train": [0, 1],
                  "weights": True, "args": {"sequence_parallel": True}}, tmp_path / "tp2sp", world_size=2)
    assert two[1]["metrics"] == {"0": {}, "1": {}}  # TP rank 1 does not report
    for r in ("0", "1"):  # rollout 1's loss is that of the weights after the first step
        for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
            assert two[0]["metrics"][r][key] == pytest.approx(one[0]["metrics"][r][key],
                                                              abs=output_tolerance("loss", cpu=1e-5)), (r, key)
    expected = torch.load(tmp_path / "tp1" / "weights_rank0.pt")
    for rank in range(2):  # hf_weights() gathers the TP shards: every rank holds the whole model
        got = torch.load(tmp_path / "tp2sp" / f"weights_rank{rank}.pt")
        assert got.keys() == expected.keys()
        worst = max((got[n] - expected[n]).abs().max().item() for n in got)
        # Adam's first steps move each weight by about lr (1e-3) x sign(grad): float-level grad differences on
        # near-zero gradients show as ~1e-4 here; TP 2 without sequence parallel measures the same (7.1e-5 after
        # one step, identical to sequence parallel's), so the bound is well under lr, not at float precision.
        assert worst <= trained_weights_tolerance(5e-4, lr=1e-3), (rank, worst)
