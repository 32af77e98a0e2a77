"""Packed micro-batches (thd, no padding) train exactly like padded ones (bshd), and only response tokens get
logits: same loss, same gradients, same log-probs as a single-sequence forward, on a batch of mixed lengths."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance  # noqa: E402
from tests.helpers.rollouts import make_rollout  # noqa: E402
from tests.helpers.trainer_runs import local_trainer  # noqa: E402
from vime.trainer import batching  # noqa: E402
from vime.trainer.batch_advantages import compute_advantages  # noqa: E402
from vime.trainer.batching import micro_batch_inputs  # noqa: E402
from vime.trainer.megatron.attention import prompt_sharing_plan  # noqa: E402
from vime.trainer.micro_batch_loss import make_loss_fn, step_denominators  # noqa: E402
from vime.trainer.passes import forward_log_probs, prompt_sharing, run_schedule  # noqa: E402
from vime.trainer.train_batch import TrainBatch  # noqa: E402
from vime.utils.misc import with_values  # noqa: E402


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


def test_samples_that_share_a_prompt_hold_one_copy_of_it_and_see_it_from_their_own_positions():
    tokens, responses = [[5, 6, 7, 8], [5, 6, 9], [11, 12, 13], [5, 6, 10, 14, 15]], [2, 1, 2, 3]
    x = micro_batch_inputs(tokens, responses, packed=True, share_prompts=True, multiple=4)
    # [5, 6] once, the three responses that continue it, the sample whose prompt is its own whole, one pad token
    assert x.tokens.tolist() == [[5, 6, 7, 8, 9, 11, 12, 13, 10, 14, 15, 0]]
    assert x.positions.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 2, 3, 4, 0]]
    assert x.cu_seqlens.tolist() == [0, 2, 4, 5, 8, 11, 12] and x.segment_prefix == [-1, 0, 0, -1, 0, -1]
    assert x.max_seqlen == 5  # the longest whole sequence: RoPE's table must reach position 4
    # a shared response's first token is predicted from the prompt's last row (1), the rest from their own
    assert x.logit_rows.tolist() == [1, 2, 1, 5, 6, 1, 8, 9] and x.targets.tolist() == [7, 8, 9, 12, 13, 10, 14, 15]
    # nothing to share: the plain packed layout
    alone = micro_batch_inputs([tokens[0], tokens[2]], [2, 2], packed=True, share_prompts=True)
    assert alone.segment_prefix is None and alone.tokens.tolist() == [[5, 6, 7, 8, 11, 12, 13]]

    # a mask of more than MAX_PROMPT_MASK_BYTES: the plain layout (3 responses x 3 x 5 = 45 bytes here)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batching, "MAX_PROMPT_MASK_BYTES", 44)
        assert micro_batch_inputs(tokens, responses, packed=True, share_prompts=True).segment_prefix is None
        mp.setattr(batching, "MAX_PROMPT_MASK_BYTES", 45)
        assert micro_batch_inputs(tokens, responses, packed=True, share_prompts=True).segment_prefix is not None

    plan = prompt_sharing_plan(x.cu_seqlens.tolist(), x.segment_prefix)
    # the responses' keys: their prompt's rows, then their own (padding reads row 0 and is masked out)
    assert plan.key_rows.view(3, -1).tolist() == [[0, 1, 2, 3, 0], [0, 1, 4, 0, 0], [0, 1, 8, 9, 10]]
    assert plan.mask[2, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert plan.mask[1, 0].int().tolist() == [[1, 1, 1, 0, 0]] * 3  # one real query; padded ones see real keys
    assert plan.alone_segments == 3 and plan.alone_rows.view(3, -1).tolist() == [[0, 1, 0], [5, 6, 7], [11, 0, 0]]
    # each packed row read back from its place in the padded outputs, alone segments first
    assert torch.cat([plan.alone_rows, plan.query_rows])[plan.restore].tolist() == list(range(12))
    assert plan.restore.tolist() == [0, 1, 9, 10, 12, 3, 4, 5, 15, 16, 17, 6]


def _loss_and_grads(t, batch, mbs, packed: bool, share_prompts: bool = False):
    for m in t.model:
        m.zero_grad_buffer()
    loss_fn = make_loss_fn(t.args, batch, step_denominators(batch, range(len(batch.tokens))), scale=len(mbs),
                           step_index=0)
    metrics = run_schedule(t.model, mbs, batch, loss_fn, forward_only=False, packed=packed,
                           share_prompts=share_prompts)
    loss = sum(float(m["loss"]) for m in metrics)
    grads = {n: p.main_grad.clone() for m in t.model for n, p in m.module.named_parameters()}
    return loss, grads


def test_packed_and_padded_training_give_the_same_loss_and_gradients(tiny_qwen3):
    groups = make_rollout(seed=7, prompt_lengths=(3, 30), response_lengths=(1, 25))
    with local_trainer(tiny_qwen3, "--entropy-coef", "0.01") as t:
        batch = TrainBatch.from_samples(groups, t.args)
        compute_advantages(t.args, batch)
        n = len(batch.tokens)
        mbs = [list(range(0, 5)), list(range(5, 11)), list(range(11, n))]
        assert len({len(batch.tokens[i]) for i in mbs[0]}) > 1  # mixed lengths within a micro-batch
        packed_loss, packed_grads = _loss_and_grads(t, batch, mbs, packed=True)
        with pytest.raises(ValueError, match="shared prompts need packed sequences"):
            _loss_and_grads(t, batch, mbs, packed=False, share_prompts=True)
        padded_loss, padded_grads = _loss_and_grads(t, batch, mbs, packed=False)
        # the groups' prompts shared within each micro-batch (groups cut across micro-batches too)
        shared_loss, shared_grads = _loss_and_grads(t, batch, mbs, packed=True, share_prompts=True)
        for loss, grads in ((padded_loss, padded_grads), (shared_loss, shared_grads)):
            assert packed_loss == pytest.approx(loss, abs=output_tolerance("loss", t.model))
            worst = max((packed_grads[k] - grads[k]).abs().max().item() for k in packed_grads)
            assert worst <= output_tolerance("grad", t.model), worst
        assert max(g.abs().max().item() for g in packed_grads.values()) > 1e-4  # gradients are not all zero

        # log-probs of a packed micro-batch equal each sequence's own forward (nothing leaks between sequences),
        # the prompts shared (the default here: a dense Qwen3 with vime's attention) or not
        assert prompt_sharing(t.args, t.model) is None
        shared_lp = forward_log_probs(t.args, t.model, batch, [list(range(n))])
        packed_lp = forward_log_probs(with_values(t.args, share_group_prompts=False), t.model, batch,
                                      [list(range(n))])
        for i in range(n):
            alone = forward_log_probs(t.args, t.model, batch, [[i]])[i][0]
            assert torch.allclose(packed_lp[i][0], alone, atol=output_tolerance("logprob", t.model)), i
            assert torch.allclose(shared_lp[i][0], alone, atol=output_tolerance("logprob", t.model)), i


@pytest.mark.parametrize("arch", ["qwen2_5", "llama3"])
def test_shared_prompts_keep_each_dense_familys_log_probs(arch, tmp_path):
    """Qwen2.5 (qkv biases) and Llama 3.1 (scaled RoPE): each response's log-probs with its group's prompt
    shared equal those of its own whole sequence."""
    from vime.synthetic.tiny_model import build_tiny_model

    groups = make_rollout(seed=3, prompt_lengths=(3, 30), response_lengths=(1, 25))
    with local_trainer(build_tiny_model(tmp_path / arch, arch=arch, seed=1)) as t:
        assert prompt_sharing(t.args, t.model) is None
        batch = TrainBatch.from_samples(groups, t.args)
        n = len(batch.tokens)
        shared = forward_log_probs(t.args, t.model, batch, [list(range(n))])
        plain = forward_log_probs(with_values(t.args, share_group_prompts=False), t.model, batch, [list(range(n))])
        worst = max((shared[i][0] - plain[i][0]).abs().max().item() for i in range(n))
        assert worst <= output_tolerance("logprob", t.model), worst


@pytest.mark.parametrize("arch, reason", [("qwen3_moe", "an MoE model"), ("deepseek_v3", "multi-latent attention")])
def test_prompt_sharing_says_why_a_model_keeps_a_prompt_per_sample(arch, reason, tmp_path):
    from vime.synthetic.tiny_model import build_tiny_model

    with local_trainer(build_tiny_model(tmp_path / arch, arch=arch, seed=1)) as t:
        assert prompt_sharing(t.args, t.model) == reason
        assert prompt_sharing(with_values(t.args, share_group_prompts=False), t.model) == "--no-share-group-prompts"
        assert prompt_sharing(with_values(t.args, qkv_format="bshd"), t.model) == "--qkv-format bshd"
        assert prompt_sharing(with_values(t.args, lora_adapters=["a=a.jsonl", "b=b.jsonl"]),
                              t.model) == "--lora-adapters"
        assert prompt_sharing(with_values(t.args, use_rollout_routing_replay=True),
                              t.model) == "--use-rollout-routing-replay"


@pytest.mark.parametrize("config", [{}, {"num_experts": 0}], ids=["qwen3_next", "qwen3_next-dense"])
def test_recurrent_layers_keep_packed_sequences_apart(config, tmp_path):
    """Qwen3-Next's Gated DeltaNet layers carry a convolution and a recurrent state along a sequence: packed, no
    sequence may start from another's. Packed and padded micro-batches give the same loss and gradients, and each
    sample's packed log-probs equal its own forward (float32, <= 1e-5); prompts are not shared, with the reason."""
    from vime.plan.run_plan import shares_prompts
    from vime.synthetic.tiny_model import build_tiny_model
    from vime.trainer.flops import FlopShape

    groups = make_rollout(seed=5, prompt_lengths=(3, 70), response_lengths=(1, 25))
    # no load-balancing loss: padded micro-batches route their padding tokens too, which it would count
    with local_trainer(build_tiny_model(tmp_path / "next", arch="qwen3_next", seed=1, config=config),
                       "--moe-aux-loss-coeff", "0") as t:
        assert prompt_sharing(t.args, t.model) == "linear-attention (Gated DeltaNet) layers"
        assert not shares_prompts(t.args, FlopShape.from_hf(t.hf_config))  # the memory planner's rule agrees
        batch = TrainBatch.from_samples(groups, t.args)
        compute_advantages(t.args, batch)
        n = len(batch.tokens)
        mbs = [list(range(0, 6)), list(range(6, n))]
        packed_loss, packed_grads = _loss_and_grads(t, batch, mbs, packed=True)
        padded_loss, padded_grads = _loss_and_grads(t, batch, mbs, packed=False)
        assert packed_loss == pytest.approx(padded_loss, abs=output_tolerance("loss", t.model))
        worst = max((packed_grads[k] - padded_grads[k]).abs().max().item() for k in packed_grads)
        assert worst <= output_tolerance("grad", t.model), worst
        linear = [k for k in packed_grads if "A_log" in k or "conv1d_weight" in k]
        assert linear and min(packed_grads[k].abs().max().item() for k in linear) > 0  # the recurrent layers train

        packed_lp = forward_log_probs(t.args, t.model, batch, [list(range(n))])
        worst = max((packed_lp[i][0] - forward_log_probs(t.args, t.model, batch, [[i]])[i][0]).abs().max().item()
                    for i in range(n))
        assert worst <= 1e-5, worst
