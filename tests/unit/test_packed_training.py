"""Packed micro-batches (thd, no padding) train exactly like padded ones (bshd), and only response tokens get
logits: same loss, same gradients, same log-probs as a single-sequence forward, on a batch of mixed lengths."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance  # noqa: E402
from tests.helpers.rollouts import make_rollout  # noqa: E402
from tests.helpers.trainer_runs import local_trainer  # noqa: E402
from vime.backends.megatron_utils.batching import micro_batch_inputs  # noqa: E402
from vime.backends.megatron_utils.train_batch import TrainBatch  # noqa: E402
from vime.backends.megatron_utils.loss import make_loss_fn  # noqa: E402
from vime.backends.megatron_utils.model import forward_log_probs, run_schedule  # noqa: E402
from vime.backends.megatron_utils.trainer import _denominators  # noqa: E402


def test_micro_batch_inputs_pack_without_padding_and_point_at_response_logits():
    tokens, responses = [[5, 6, 7, 8], [9, 10], [11, 12, 13]], [2, 1, 2]
    packed = micro_batch_inputs(tokens, responses, packed=True)
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert packed.positions.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert packed.cu_seqlens.tolist() == [0, 4, 6, 9] and packed.max_seqlen == 4
    # the logits predicting token t sit one position before it
    assert packed.logit_rows.tolist() == [1, 2, 4, 6, 7] and packed.targets.tolist() == [7, 8, 10, 12, 13]
    padded = micro_batch_inputs(tokens, responses, packed=False)
    assert padded.tokens.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0], [11, 12, 13, 0]]
    # rows of the [seq, batch] flattened hidden states: position * batch + row
    assert padded.logit_rows.tolist() == [1 * 3 + 0, 2 * 3 + 0, 0 * 3 + 1, 0 * 3 + 2, 1 * 3 + 2]
    assert padded.targets.tolist() == packed.targets.tolist()


def _loss_and_grads(t, batch, mbs, packed: bool):
    for m in t.model:
        m.zero_grad_buffer()
    loss_fn = make_loss_fn(t.args, batch, _denominators(batch, range(len(batch.tokens))), scale=len(mbs),
                           step_index=0)
    metrics = run_schedule(t.model, mbs, batch, loss_fn, forward_only=False, packed=packed)
    loss = sum(float(m["loss"]) for m in metrics)
    grads = {n: p.main_grad.clone() for m in t.model for n, p in m.module.named_parameters()}
    return loss, grads


def test_packed_and_padded_training_give_the_same_loss_and_gradients(tiny_qwen3):
    groups = make_rollout(seed=7, prompt_lengths=(3, 30), response_lengths=(1, 25))
    with local_trainer(tiny_qwen3, "--entropy-coef", "0.01") as t:
        batch = TrainBatch.from_samples(groups, t.args)
        t._compute_advantages(batch)
        n = len(batch.tokens)
        mbs = [list(range(0, 5)), list(range(5, 11)), list(range(11, n))]
        assert len({len(batch.tokens[i]) for i in mbs[0]}) > 1  # mixed lengths within a micro-batch
        packed_loss, packed_grads = _loss_and_grads(t, batch, mbs, packed=True)
        padded_loss, padded_grads = _loss_and_grads(t, batch, mbs, packed=False)
        assert packed_loss == pytest.approx(padded_loss, abs=output_tolerance("loss", t.model))
        worst = max((packed_grads[k] - padded_grads[k]).abs().max().item() for k in packed_grads)
        assert worst <= output_tolerance("grad", t.model), worst
        assert max(g.abs().max().item() for g in packed_grads.values()) > 1e-4  # gradients are not all zero

        # log-probs of a packed micro-batch equal each sequence's own forward (nothing leaks between sequences)
        packed_lp = forward_log_probs(t.args, t.model, batch, [list(range(n))])
        for i in range(n):
            alone = forward_log_probs(t.args, t.model, batch, [[i]])[i][0]
            assert torch.allclose(packed_lp[i][0], alone, atol=output_tolerance("logprob", t.model)), i
