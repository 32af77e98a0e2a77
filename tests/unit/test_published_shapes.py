"""Published model shapes without downloads (issue 52): each published config.json (`vime.plan.published`) builds
vime's Megatron model on the meta device, whose parameter count must equal transformers' own model of the config
and the model card's total; and the HF <-> Megatron conversion map must cover every tensor of the published
checkpoint, in both directions, with the published shapes.

The checkpoint's tensor names and shapes are written here from the published `model.safetensors.index.json`
naming (no download): the decoder's tensors, plus the multi-token-prediction layers stored after them, which vime
declares and does not load (`hf_architecture.multi_token_prediction_layers`). Everything is meta tensors: no
weight is allocated.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import pytest
import torch

pytest.importorskip("megatron.core")

# the model card's total parameters (billions) and the precision it states them to
MODEL_CARD_TOTAL = {"GLM-4.5-Air": (106, 1.0), "Qwen3-Next-80B-A3B": (80, 1.0), "Qwen3.5-35B-A3B": (35, 1.0),
                    "Qwen3.5-27B": (27, 1.0)}


def _glm4_moe_index(c) -> dict[str, tuple[int, ...]]:
    """GLM-4.5's checkpoint: per layer q/k/v (with biases) and o projections, QK-norms where `use_qk_norm`, a
    dense MLP in the first `first_k_dense_replace` layers and elsewhere the router (weight and expert bias), the
    routed experts and the shared experts; its MTP layers (index num_hidden_layers on) hold a whole MoE layer plus
    eh_proj, enorm, hnorm and the shared head."""
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (c.vocab_size, h)}

    def mlp(prefix: str, width: int) -> dict:
        return {f"{prefix}.gate_proj.weight": (width, h), f"{prefix}.up_proj.weight": (width, h),
                f"{prefix}.down_proj.weight": (h, width)}

    for i in range(c.num_hidden_layers + c.num_nextn_predict_layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                       f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.q_proj.bias": (q,),
                       f"{p}.self_attn.k_proj.weight": (kv, h), f"{p}.self_attn.k_proj.bias": (kv,),
                       f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.v_proj.bias": (kv,),
                       f"{p}.self_attn.o_proj.weight": (h, q)})
        if c.use_qk_norm:
            shapes.update({f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)})
        if i < c.first_k_dense_replace:
            shapes.update(mlp(f"{p}.mlp", c.intermediate_size))
            continue
        shapes.update({f"{p}.mlp.gate.weight": (c.n_routed_experts, h),
                       f"{p}.mlp.gate.e_score_correction_bias": (c.n_routed_experts,),
                       **mlp(f"{p}.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)})
        for e in range(c.n_routed_experts):
            shapes.update(mlp(f"{p}.mlp.experts.{e}", c.moe_intermediate_size))
        if i >= c.num_hidden_layers:  # the MTP layer's own tensors
            shapes.update({f"{p}.eh_proj.weight": (h, 2 * h), f"{p}.enorm.weight": (h,), f"{p}.hnorm.weight": (h,),
                           f"{p}.shared_head.norm.weight": (h,)})
    return shapes


def _qwen3_next_index(c) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next's checkpoint: per layer either Gated DeltaNet (`linear_attn`: in_proj_qkvz, in_proj_ba, conv1d,
    dt_bias, A_log, norm, out_proj) or gated attention (`self_attn`: q_proj twice as wide, holding the output
    gate, q/k norms), then the router, the routed experts, one shared expert and its gate (or, in a dense model,
    one MLP); its MTP block under
    `mtp.` (fc, pre-fc norms, a full-attention MoE layer, norm)."""
    h, d = c.hidden_size, c.head_dim
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (c.vocab_size, h), "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,),
              "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,)}

    def mlp(prefix: str, width: int) -> dict:
        return {f"{prefix}.gate_proj.weight": (width, h), f"{prefix}.up_proj.weight": (width, h),
                f"{prefix}.down_proj.weight": (h, width)}

    for p, kind in [(f"model.layers.{i}", t) for i, t in enumerate(c.layer_types)] + [("mtp.layers.0",
                                                                                        "full_attention")]:
        shapes.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)})
        if getattr(c, "num_experts", 0):
            shapes.update({f"{p}.mlp.gate.weight": (c.num_experts, h), f"{p}.mlp.shared_expert_gate.weight": (1, h),
                           **mlp(f"{p}.mlp.shared_expert", c.shared_expert_intermediate_size)})
            for e in range(c.num_experts):
                shapes.update(mlp(f"{p}.mlp.experts.{e}", c.moe_intermediate_size))
        else:  # a dense model (Qwen3.5-27B): one MLP per layer
            shapes.update(mlp(f"{p}.mlp", c.intermediate_size))
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            shapes.update({f"{a}.in_proj_qkvz.weight": (2 * kd + 2 * vd, h),
                           f"{a}.in_proj_ba.weight": (2 * c.linear_num_value_heads, h),
                           f"{a}.conv1d.weight": (2 * kd + vd, 1, c.linear_conv_kernel_dim),
                           f"{a}.dt_bias": (c.linear_num_value_heads,), f"{a}.A_log": (c.linear_num_value_heads,),
                           f"{a}.norm.weight": (c.linear_value_head_dim,), f"{a}.out_proj.weight": (h, vd)})
        else:
            q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
            shapes.update({f"{p}.self_attn.q_proj.weight": (2 * q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                           f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
                           f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)})
    return shapes


def _qwen3_5_index(c) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's checkpoint: its language model under `model.language_model.` (Qwen3-Next's layers with the linear
    attention's input projection as in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), the vision tower under
    `model.visual.` (its names and shapes as transformers' own model holds them), the MTP block under `mtp.`."""
    from transformers import AutoModelForImageTextToText

    t = c.text_config
    shapes = {f"model.language_model.{n.removeprefix('model.')}" if n.startswith("model.") else n: s
              for n, s in _qwen3_next_index(t).items() if not n.startswith("mtp.")}
    kd, vd = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
    for i, kind in enumerate(t.layer_types):
        if kind == "linear_attention":
            a = f"model.language_model.layers.{i}.linear_attn"
            del shapes[f"{a}.in_proj_qkvz.weight"], shapes[f"{a}.in_proj_ba.weight"]
            shapes.update({f"{a}.in_proj_qkv.weight": (2 * kd + vd, t.hidden_size),
                           f"{a}.in_proj_z.weight": (vd, t.hidden_size),
                           f"{a}.in_proj_b.weight": (t.linear_num_value_heads, t.hidden_size),
                           f"{a}.in_proj_a.weight": (t.linear_num_value_heads, t.hidden_size)})
    shapes.update({n: s for n, s in _qwen3_next_index(t).items() if n.startswith("mtp.")})
    with torch.device("meta"):
        vision = AutoModelForImageTextToText.from_config(c).model.visual
    shapes.update({f"model.visual.{n}": tuple(p.shape) for n, p in vision.named_parameters()})
    return shapes


PUBLISHED_INDEX = {"GLM-4.5-Air": _glm4_moe_index, "Qwen3-Next-80B-A3B": _qwen3_next_index,
                   "Qwen3.5-35B-A3B": _qwen3_5_index, "Qwen3.5-27B": _qwen3_5_index}


class _Reads(Mapping):
    """The published checkpoint as meta tensors, recording which names a conversion reads."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes, self.read = shapes, set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return torch.empty(self.shapes[name], device="meta")

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


@pytest.fixture(scope="module")
def megatron_world():
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, seed=1234)
    yield
    destroy_parallel()


def _not_trained(name: str, config) -> bool:
    """A tensor vime's trainer does not hold: a multi-token-prediction layer after the decoder's (DeepSeek's and
    GLM's layout) or Qwen's `mtp.` block, or a vision tower's."""
    parts = name.split(".")
    return parts[0] == "mtp" or parts[:2] == ["model", "visual"] or (
        parts[:2] == ["model", "layers"] and int(parts[2]) >= config.num_hidden_layers)


@pytest.mark.parametrize("name", list(PUBLISHED_INDEX))
def test_published_model_builds_at_its_size_and_converts_every_tensor(name, megatron_world):
    from transformers import AutoModelForCausalLM

    from vime.plan.memory import TrainerLayout, stage_parameters
    from vime.plan.published import hf_config
    from vime.trainer.flops import FlopShape
    from vime.trainer.megatron.arguments import add_megatron_args, fill_architecture_from_hf
    from vime.trainer.megatron.hf_architecture import language_config, multi_token_prediction_layers
    from vime.trainer.megatron.hf_conversion import hf_to_megatron_state_dict, megatron_to_hf_state_dict
    from vime.trainer.megatron.model_provider import build_gpt_model

    config = hf_config(name)
    args = fill_architecture_from_hf(add_megatron_args(argparse.ArgumentParser()).parse_args([]), config)
    # meta tensors hold no values to draw: without this, torch's reference normal_ on meta is most of the test's
    # time (Qwen3-Next's 24k experts: ~190 s of ~220 s here)
    args.perform_initialization = False
    with torch.device("meta"):
        model = build_gpt_model(args)
        reference = AutoModelForCausalLM.from_config(language_config(config))
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in reference.parameters())  # transformers' own model of the config
    shape = FlopShape.from_hf(config)  # the memory planner's count of the same weights (its weights column)
    planned = stage_parameters(shape, TrainerLayout(), 0, bool(language_config(config).tie_word_embeddings))
    assert planned == pytest.approx(count, rel=1e-3), (planned, count)

    index = PUBLISHED_INDEX[name](config)
    vision = sum(torch.Size(s).numel() for n, s in index.items() if n.startswith("model.visual."))
    total, precision = MODEL_CARD_TOTAL[name]
    size = (count + vision) / 1e9  # the card counts a multimodal model's vision tower too
    assert abs(size - total) < precision, f"{name}: {size:.2f}B parameters, the card says {total}B"
    mtp = {n for n in index if _not_trained(n, language_config(config))}
    assert mtp and (name.startswith("Qwen") or multi_token_prediction_layers(config))  # declared (GLM), skipped
    ours = {n: t.shape for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    checkpoint = _Reads(index)
    converted = hf_to_megatron_state_dict(checkpoint, config)
    assert {n: t.shape for n, t in converted.items()} == ours  # every Megatron tensor, at its shape
    assert checkpoint.read == set(index) - mtp  # every published decoder tensor is read
    back = megatron_to_hf_state_dict([converted], config)
    assert {n: tuple(t.shape) for n, t in back.items()} == {n: s for n, s in index.items() if n not in mtp}
    assert sum(torch.Size(s).numel() for n, s in index.items() if n not in mtp and "e_score" not in n) == count


# slime's scripts/models/qwen3.5-27B.sh, MODEL_ARGS as written there
SLIME_QWEN3_5_27B = (
    "--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec --disable-bias-linear --qk-layernorm --group-query-attention "
    "--num-attention-heads 24 --num-query-groups 4 --kv-channels 256 --num-layers 64 --hidden-size 5120 "
    "--ffn-hidden-size 17408 --use-gated-attention --normalization RMSNorm --apply-layernorm-1p "
    "--position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 0.25 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 248320 --rotary-base 10000000 --attention-output-gate").split()


def test_slime_qwen3_5_27b_script_agrees_with_the_published_config():
    """The flagship's launch script (slime's Qwen3.5-27B model flags) reads against the published config without a
    contradiction, and a flag that disagrees with it is refused naming both values."""
    from vime.plan.published import hf_config
    from vime.trainer.megatron.arguments import add_megatron_args, fill_architecture_from_hf

    config = hf_config("Qwen3.5-27B")
    args = fill_architecture_from_hf(add_megatron_args(argparse.ArgumentParser()).parse_args(SLIME_QWEN3_5_27B), config)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (64, 5120, 17408, 24)
    assert (args.num_query_groups, args.kv_channels, args.rotary_percent, args.vocab_size) == (4, 256, 0.25, 248320)
    layers = SLIME_QWEN3_5_27B.index("--num-layers") + 1
    wrong = SLIME_QWEN3_5_27B[:layers] + ["48"] + SLIME_QWEN3_5_27B[layers + 1:]
    with pytest.raises(ValueError, match="--num-layers"):
        fill_architecture_from_hf(add_megatron_args(argparse.ArgumentParser()).parse_args(wrong), config)


@pytest.mark.parametrize("name", list(PUBLISHED_INDEX))
def test_every_published_mtp_tensor_maps_to_the_trainers_mtp_layer(name):
    """With --mtp-num-layers, the last stage's conversion reads every multi-token-prediction tensor of the published
    checkpoint (GLM's layer after the decoder's, Qwen's `mtp.` block) and nothing else of it but the final norm and
    the output layer, and gives each Megatron tensor the shape Megatron's MTP layer has."""
    from vime.plan.published import hf_config
    from vime.trainer.megatron.hf_architecture import language_config, multi_token_prediction_layers
    from vime.trainer.megatron.hf_conversion import Arch, hf_to_chunk

    config = hf_config(name)
    text = language_config(config)
    index = PUBLISHED_INDEX[name](config)
    mtp = {n for n in index if _not_trained(n, text) and not n.startswith("model.visual.")}
    assert multi_token_prediction_layers(config) == 1 and len(mtp) > 10
    arch = Arch.from_hf(config, mtp_layers=1)
    checkpoint = _Reads(index)
    converted = hf_to_chunk(checkpoint, arch, 0, 1, arch.num_layers, 0, False, True)
    head = {n for n in index if n == "lm_head.weight" or n.endswith("language_model.norm.weight")
            or n == "model.norm.weight"}
    assert checkpoint.read == mtp | head
    h = text.hidden_size
    assert converted["mtp.layers.0.eh_proj.weight"].shape == (h, 2 * h)
    assert converted["mtp.layers.0.enorm.weight"].shape == (h,)
    assert converted["mtp.layers.0.final_layernorm.weight"].shape == (h,)
    assert any(n.startswith("mtp.layers.0.transformer_layer.mlp.") for n in converted)
