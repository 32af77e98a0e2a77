"""Multi-token-prediction (MTP) layers in the trainer (issue 53, items 1, 2 and 6), on tiny GLM-4.5 and DeepSeek-V3
checkpoints whose MTP layers are stored as the published ones are:

- conversion keeps them: HF -> Megatron -> HF bit for bit, MTP tensors included;
- each layer computes what vLLM's drafter computes: the cross-entropy of every response token from two positions
  before it equals a reference built from transformers' own decoder layer (the MTP layer's weights in a one-layer
  model of the family) and the HF trunk, packed and padded;
- --enable-mtp-training trains the MTP layers only: the policy's weights after three steps and its gradient norm
  are the same, bit for bit, as with the MTP layers frozen; the MTP layers move and their loss falls;
- bad combinations are refused before anything starts, naming the flags.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

from tests.helpers.rollouts import make_rollout
from tests.helpers.trainer_runs import local_trainer

ARCHS = ("glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5")
UNDER_MTP = ("qwen3_next", "qwen3_5")  # their MTP block is stored under `mtp.`, as Qwen publishes it


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict:
    from vime.synthetic.tiny_model import build_tiny_model

    return {arch: build_tiny_model(tmp_path_factory.mktemp(f"mtp_{arch}"), arch=arch, seed=0, with_mtp=True)
            for arch in ARCHS}


def _megatron_model(path, *flags: str):
    from transformers import AutoConfig

    from vime.trainer.megatron.arguments import add_megatron_args, fill_architecture_from_hf
    from vime.trainer.megatron.hf_checkpoint import load_hf_checkpoint_into_model
    from vime.trainer.megatron.model_provider import build_model_chunks

    config = AutoConfig.from_pretrained(path)
    args = fill_architecture_from_hf(add_megatron_args(argparse.ArgumentParser()).parse_args(list(flags)), config)
    chunks = build_model_chunks(args)
    load_hf_checkpoint_into_model(chunks, path)
    return chunks, config


@pytest.fixture
def megatron_world():
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, seed=1234)
    yield
    destroy_parallel()


@pytest.mark.parametrize("arch", ARCHS)
def test_conversion_keeps_the_mtp_layers_bit_for_bit(arch, mtp_models, megatron_world):
    from safetensors.torch import load_file

    from vime.trainer.megatron.hf_checkpoint import iter_hf_weights

    chunks, config = _megatron_model(mtp_models[arch], "--mtp-num-layers", "1")
    hf = load_file(mtp_models[arch] / "model.safetensors")
    back = dict(iter_hf_weights(chunks, config))
    if arch in UNDER_MTP:
        mtp = {n for n in hf if n.startswith("mtp.")}
        assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= mtp
    else:
        mtp = {n for n in hf if n.startswith(f"model.layers.{config.num_hidden_layers}.")}
        assert {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"} <= {
            n.split(".", 3)[3] for n in mtp}
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)
    without, _ = _megatron_model(mtp_models[arch])  # no --mtp-num-layers: the decoder only, as before
    assert set(dict(iter_hf_weights(without, config))) == set(hf) - mtp


def _reference_mtp_cross_entropy(path, config, sequences, response_lengths, under_mtp: bool) -> torch.Tensor:
    """vLLM's drafter, computed from transformers' pieces: the HF trunk's output (after its final norm), the
    embedding of the next token (zero at position 0, except Qwen's), each normed, [embedding; hidden] through
    eh_proj (Qwen's `mtp.fc`), then the MTP layer as the only layer of a model of the family (its final norm is
    shared_head.norm, Qwen's `mtp.norm`), the lm head."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    weights = load_file(path / "model.safetensors")
    if under_mtp:  # Qwen's names, as DeepSeek's: the layer's own tensors, and the decoder layer's under layers.0
        qwen = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
                "norm": "shared_head.norm"}
        mtp = {n[len("mtp.layers.0."):]: t for n, t in weights.items() if n.startswith("mtp.layers.0.")}
        mtp.update({f"{qwen[n.split('.')[1]]}.weight": t for n, t in weights.items()
                    if n.startswith("mtp.") and not n.startswith("mtp.layers.")})
    else:
        prefix = f"model.layers.{config.num_hidden_layers}."
        mtp = {n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)}
    one_layer = copy.deepcopy(config)
    one_layer.num_hidden_layers, one_layer.first_k_dense_replace = 1, 0
    if under_mtp:
        one_layer.layer_types = ["full_attention"]
    drafter_dir = path.parent / f"{path.name}_drafter"
    drafter_dir.mkdir(exist_ok=True)
    one_layer.save_pretrained(drafter_dir)
    drafter = {f"model.layers.0.{n}": t for n, t in mtp.items()
               if n.split(".")[0] not in ("eh_proj", "enorm", "hnorm", "shared_head")}
    drafter.update({"model.embed_tokens.weight": weights["model.embed_tokens.weight"],
                    "model.norm.weight": mtp["shared_head.norm.weight"], "lm_head.weight": weights["lm_head.weight"]})
    save_file(drafter, drafter_dir / "model.safetensors", metadata={"format": "pt"})
    layer = AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32).eval()

    def norm(x, name):  # Qwen's norms scale by 1 + weight
        w = mtp[f"{name}.weight"]
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=config.rms_norm_eps) * (1 + w) if under_mtp \
            else torch.nn.functional.rms_norm(x, (x.shape[-1],), w, config.rms_norm_eps)

    out = []
    with torch.no_grad():
        for tokens, response in zip(sequences, response_lengths):
            ids = torch.tensor([tokens])
            next_ids = torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=torch.long)], dim=1)
            embedded = hf.model.embed_tokens(next_ids)
            if not under_mtp:
                embedded[0, 0] = 0
            x = torch.cat([norm(embedded, "enorm"), norm(hf.model(ids).last_hidden_state, "hnorm")], -1)
            logits = layer(inputs_embeds=x @ mtp["eh_proj.weight"].t()).logits[0]
            for q in range(len(tokens) - response, len(tokens)):  # predicted from position q - 2, if any
                out.append(torch.nn.functional.cross_entropy(logits[q - 2], torch.tensor(tokens[q])) if q >= 2
                           else torch.tensor(0.0))
    return torch.stack(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_mtp_layer_computes_what_the_engine_drafts_with(arch, mtp_models, megatron_world):
    from vime.trainer.batching import micro_batch_inputs
    from vime.trainer.mtp_loss import mtp_cross_entropy
    from vime.trainer.passes import packed_seq_params

    chunks, config = _megatron_model(mtp_models[arch], "--mtp-num-layers", "1", "--enable-mtp-training")
    g = torch.Generator().manual_seed(0)
    # the last sample's prompt is one token: its first response token has no position two before it (weight 0)
    sequences = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (9, 13, 6, 5)]
    responses = [4, 5, 3, 4]
    reference = _reference_mtp_cross_entropy(mtp_models[arch], config, sequences, responses, arch in UNDER_MTP)
    for packed in (True, False):
        mb = micro_batch_inputs(sequences, responses, packed=packed)
        with mtp_cross_entropy(chunks[0], mb, mb.tokens, mb.positions) as result:
            chunks[0](mb.tokens, mb.positions, attention_mask=None, packed_seq_params=packed_seq_params(mb))
        torch.testing.assert_close(result.ce[0].detach(), reference, atol=1e-5, rtol=0)
        assert result.ce[0][12] == 0 and bool((result.ce[0][:12] > 0).all())


def test_mtp_training_trains_the_mtp_layers_and_leaves_the_policy_bit_identical(mtp_models):
    path = mtp_models["glm4_moe"]
    groups = make_rollout(seed=3)
    runs = {}
    for name, flags in (("frozen", ["--mtp-num-layers", "1"]),
                        ("trained", ["--mtp-num-layers", "1", "--enable-mtp-training"])):
        with local_trainer(path, "--global-batch-size", "16", *flags) as t:
            before = {n: w.clone() for n, w in t.hf_weights()}
            metrics = [t.train(r, copy.deepcopy(groups)) for r in range(3)]
            runs[name] = (before, {n: w.clone() for n, w in t.hf_weights()}, metrics)
    mtp = "model.layers.2."  # the tiny model's two decoder layers, then its MTP layer
    (before, frozen, frozen_metrics), (_, trained, trained_metrics) = runs["frozen"], runs["trained"]
    policy = [n for n in before if not n.startswith(mtp)]
    assert all(torch.equal(frozen[n], trained[n]) for n in policy)  # the policy: bit for bit
    assert any(not torch.equal(before[n], frozen[n]) for n in policy)  # ... and it did train
    assert [m["train/grad_norm"] for m in frozen_metrics] == [m["train/grad_norm"] for m in trained_metrics]
    assert all(torch.equal(before[n], frozen[n]) for n in before if n.startswith(mtp))  # frozen: as loaded
    assert any(not torch.equal(before[n], trained[n]) for n in before if n.startswith(mtp))
    losses = [m["train/mtp_loss"] for m in trained_metrics]
    assert "train/mtp_loss" not in frozen_metrics[0]
    assert losses[-1] < losses[0], losses  # the same rollout three times: its MTP loss falls


@pytest.mark.parametrize("arch, layout", [("glm4_moe", "--expert-model-parallel-size"),
                                          ("qwen3_5", "--tensor-model-parallel-size")], ids=["glm-ep2", "qwen3_5-tp2"])
def test_mtp_layers_over_two_ranks_train_like_one_process(arch, layout, mtp_models, tmp_path):
    """The MTP layer trained on 2 gloo processes: GLM-4.5's experts (the MTP layer's too) over 2 expert-parallel
    ranks; dense Qwen3.5 at TP=2 (eh_proj a column-parallel layer gathered, the attention split as the decoder's;
    Megatron asks sequence parallel of MoE under TP, which the MTP layers do not take yet). Per rollout the same
    MTP loss and grad norm as one process, and after two steps the same MTP weights (which needs the MTP logits'
    gradient summed over the output layer's vocabulary shards: without it the second MTP loss was 5e-4 off)."""
    from tests.helpers.devices import output_tolerance
    from tests.helpers.trainer_runs import BASE_ARGV, launch

    path = mtp_models[arch]
    flags = ["--global-batch-size", "16", "--mtp-num-layers", "1", "--enable-mtp-training"]
    data = {str(r): make_rollout(seed=30 + r) for r in range(2)}
    mtp = "mtp." if arch in UNDER_MTP else "model.layers.2."
    with local_trainer(path, *flags) as t:
        one = [t.train(r, copy.deepcopy(data[str(r)])) for r in range(2)]
        one_weights = {n: w.clone() for n, w in t.hf_weights() if n.startswith(mtp)}
    argv = ["--hf-checkpoint", str(path), *BASE_ARGV, *flags, layout, "2"]
    reports = launch({"argv": argv, "data": data, "train": [0, 1], "weights": True}, tmp_path, world_size=2,
                     timeout_s=180)
    tolerance = output_tolerance("loss", cpu=1e-5)
    for r, expected in enumerate(one):
        got = reports[0]["metrics"][str(r)]
        for key in ("train/mtp_loss", "train/loss"):
            assert got[key] == pytest.approx(expected[key], abs=tolerance), (r, key)
        # (Qwen3.5's Gated DeltaNet layers at TP=2 move the policy's grad norm by 6e-6 relative, MTP layers or not)
        assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=2e-5), r
    two_weights = torch.load(tmp_path / "weights_rank0.pt")
    assert len(one_weights) > 8 and set(one_weights) <= set(two_weights)
    for name, w in one_weights.items():  # Adam's step is ~lr whatever a gradient's size: near-zero gradients'
        torch.testing.assert_close(two_weights[name], w, atol=1e-4, rtol=0)  # float noise moves some by 5e-5
    assert one[1]["train/mtp_loss"] != one[0]["train/mtp_loss"]


@pytest.mark.parametrize("flags, match", [
    (["--enable-mtp-training"], r"--enable-mtp-training needs --mtp-num-layers N"),
    (["--mtp-num-layers", "2"], r"--mtp-num-layers 2: the checkpoint declares 1 MTP layer\(s\)"),
    (["--mtp-num-layers", "1", "--lora-rank", "4"], r"--mtp-num-layers with --lora-rank is not supported yet"),
])
def test_bad_mtp_flags_are_refused_naming_them(flags, match, mtp_models):
    from transformers import AutoConfig

    from vime.config.section import add_flags
    from vime.config.train import LoraConfig
    from vime.trainer.megatron.arguments import add_megatron_args, fill_architecture_from_hf

    parser = add_megatron_args(argparse.ArgumentParser())
    add_flags(parser, LoraConfig)
    with pytest.raises(ValueError, match=match):
        fill_architecture_from_hf(parser.parse_args(flags), AutoConfig.from_pretrained(mtp_models["glm4_moe"]))


def test_mtp_layers_of_a_family_without_them_are_refused(tiny_qwen3):
    from transformers import AutoConfig

    from vime.trainer.megatron.arguments import add_megatron_args, fill_architecture_from_hf

    with pytest.raises(ValueError, match=r"vime reads MTP layers from deepseek_v3, glm4_moe, .* checkpoints, "
                                         r"not qwen3;"):
        fill_architecture_from_hf(add_megatron_args(argparse.ArgumentParser()).parse_args(["--mtp-num-layers", "1"]),
                                  AutoConfig.from_pretrained(tiny_qwen3))
