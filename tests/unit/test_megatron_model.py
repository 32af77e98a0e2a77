"""Megatron-core GPTModel vs transformers on tiny Qwen2 / Qwen2.5 / Qwen3 / Llama / Llama 3.x / Qwen3-MoE /
DeepSeek-V3 / GLM-4.5 / Qwen3-Next checkpoints (one process, CPU).

Checks: logits equal transformers' within 1e-5 (float32, eager attention; on a GPU, where the model is built, within
vime.utils.tolerances' bound); HF -> Megatron -> HF is bit-exact, also through TP/PP sharding; architecture flags
fill from / are checked against the HF config; validation.
"""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance, to_device_of  # noqa: E402
from vime.trainer.megatron.arguments import (  # noqa: E402
    add_megatron_args,
    fill_architecture_from_hf,
    validate_megatron_args,
)
from vime.trainer.megatron.hf_checkpoint import load_hf_checkpoint_into_model, save_hf_checkpoint  # noqa: E402
from vime.trainer.megatron.hf_conversion import (  # noqa: E402
    hf_to_megatron_state_dict,
    megatron_to_hf_state_dict,
)

CASES = {  # name -> (arch, tie_word_embeddings)
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "llama": ("llama", False),
    "qwen3-tied": ("qwen3", True),
    "qwen2_5-tied": ("qwen2_5", True),  # Qwen2.5-0.5B..3B tie their embeddings
    "llama3": ("llama3", False),  # Llama 3.1's rope_scaling block, as published
    "llama3-tied": ("llama3", True),  # Llama 3.2 1B / 3B
    "qwen3_moe": ("qwen3_moe", False),  # a dense first layer, then 4 experts, top-2
    "deepseek_v3": ("deepseek_v3", False),  # MLA with YaRN; a dense layer, then 4 sigmoid-routed experts + 1 shared
    # GLM-4.5: qkv biases, RoPE on half of each head, QK-norm; a dense layer, then 4 sigmoid-routed experts + 1 shared
    "glm4_moe": ("glm4_moe", False),
    "glm4_moe-air": ("glm4_moe", False, {"use_qk_norm": False}),  # GLM-4.5-Air has no QK-norm
    # Qwen3-Next: 3 Gated DeltaNet layers, then gated full attention (RoPE on a quarter of each head), norms by
    # 1 + weight, 4 softmax-routed experts and a gated shared expert; and its dense form (Qwen3.5-27B's layout)
    "qwen3_next": ("qwen3_next", False),
    "qwen3_next-dense": ("qwen3_next", True, {"num_experts": 0}),
    # Qwen3.5's language model: Qwen3-Next's layers with the linear attention's input projection as four matrices
    "qwen3_5": ("qwen3_5", False),
    "qwen3_5_moe": ("qwen3_5_moe", False),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from vime.synthetic.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny_model(root / name, arch=arch, seed=7, tie_word_embeddings=tied, config=config[0])
            for name, (arch, tied, *config) in ((n, (*c, None)) for n, c in CASES.items())}


@pytest.fixture(scope="module")
def megatron_world():
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, seed=1234)
    yield
    destroy_parallel()


def hf_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def megatron_args(argv=(), config=None) -> argparse.Namespace:
    args = add_megatron_args(argparse.ArgumentParser()).parse_args(list(argv))
    if config is not None:
        args = fill_architecture_from_hf(args, config)
    return args


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tiny_models, megatron_world):
    from transformers import AutoModelForCausalLM

    from vime.trainer.megatron.model_provider import build_model_chunks

    path = tiny_models[case]
    args = megatron_args(config=hf_config(path))
    model = build_model_chunks(args)
    load_hf_checkpoint_into_model(model, path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    # long enough that Llama 3's scaled low frequencies turn by a visible angle
    tokens = torch.randint(0, 512, (2, 600), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits  # the CPU float32 reference
        got = model[0].eval()(to_device_of(model, tokens), to_device_of(model, positions), attention_mask=None).cpu()
    assert got.shape == expected.shape == (2, 600, 512)
    gap = (got - expected).abs().max().item()
    assert gap < output_tolerance("logprob", model)  # logits: a log-prob is a logit less a shared logsumexp
    if args.rope_scaling is not None:  # the scaling is what makes them agree: plain RoPE would not
        plain = build_model_chunks(argparse.Namespace(**{**vars(args), "rope_scaling": None}))
        load_hf_checkpoint_into_model(plain, path)
        with torch.no_grad():
            off = plain[0].eval()(to_device_of(plain, tokens), to_device_of(plain, positions), attention_mask=None)
        # 9e-3 (llama3) and 0.1 (YaRN) on CPU; twice the scaled gap too, which TF32 kernels on a GPU widen
        assert (off.cpu() - expected).abs().max().item() > max(1e-3, 2 * gap)
    if args.rotary_percent < 1:  # RoPE on the whole head would not agree: the partial rotary is read and applied
        whole = build_model_chunks(argparse.Namespace(**{**vars(args), "rotary_percent": 1.0}))
        load_hf_checkpoint_into_model(whole, path)
        with torch.no_grad():
            off = whole[0].eval()(to_device_of(whole, tokens), to_device_of(whole, positions), attention_mask=None)
        assert (off.cpu() - expected).abs().max().item() > max(1e-3, 2 * gap)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_megatron_hf_round_trip_is_bit_exact(case, tiny_models):
    path = tiny_models[case]
    config, hf = hf_config(path), load_file(path / "model.safetensors")
    back = megatron_to_hf_state_dict([hf_to_megatron_state_dict(hf, config)], config)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("case", ["qwen2", "qwen3-tied", "qwen2_5-tied", "llama3", "qwen3_next", "qwen3_5_moe"])
def test_round_trip_through_tp_and_pp_shards(case, tiny_models):
    path = tiny_models[case]
    config, hf = hf_config(path), load_file(path / "model.safetensors")
    back = {}
    for pp_rank in range(2):
        shards = [hf_to_megatron_state_dict(hf, config, tp_rank, 2, pp_rank, 2) for tp_rank in range(2)]
        assert shards[0].keys() == shards[1].keys()
        if pp_rank == 1 and config.tie_word_embeddings:  # last stage keeps a copy of the tied embedding
            assert torch.equal(torch.cat([s["output_layer.weight"] for s in shards]), hf["model.embed_tokens.weight"])
        back.update(megatron_to_hf_state_dict(shards, config, pp_rank, 2))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_moe_round_trip_through_tp_pp_and_ep_shards(case, tiny_models):
    path = tiny_models[case]
    config, hf = hf_config(path), load_file(path / "model.safetensors")
    back = {}
    for pp_rank in range(2):
        for ep_rank in range(2):
            shards = [hf_to_megatron_state_dict(hf, config, tp_rank, 2, pp_rank, 2, ep_rank, 2) for tp_rank in range(2)]
            if pp_rank == 1:  # the MoE layer: two of the four experts on each EP rank, under local indices
                experts = {k for k in shards[0] if ".local_experts." in k}
                assert experts == {f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{f}.weight"
                                   for e in range(2) for f in (1, 2)}
                first = hf[f"model.layers.1.mlp.experts.{2 * ep_rank}.down_proj.weight"]
                assert torch.equal(shards[1]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"],
                                   first.chunk(2, dim=1)[1])
            back.update(megatron_to_hf_state_dict(shards, config, pp_rank, 2, ep_rank, 2))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qkv_is_interleaved_per_kv_group(tiny_models):
    config = hf_config(tiny_models["qwen2"])
    hf = load_file(tiny_models["qwen2"] / "model.safetensors")
    qkv = hf_to_megatron_state_dict(hf, config)["decoder.layers.0.self_attention.linear_qkv.bias"]
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv")
    # 4 query heads, 2 KV groups, head_dim 32: [q0 q1 k0 v0 | q2 q3 k1 v1]
    assert torch.equal(qkv, torch.cat([q[:64], k[:32], v[:32], q[64:], k[32:], v[32:]]))


def test_model_save_hf_checkpoint_round_trip(tiny_models, megatron_world, tmp_path):
    from vime.trainer.megatron.model_provider import build_model_chunks

    path = tiny_models["qwen2"]
    model = build_model_chunks(megatron_args(config=hf_config(path)))
    load_hf_checkpoint_into_model(model, path)
    save_hf_checkpoint(model, path, tmp_path / "out")
    original, saved = load_file(path / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (path / name).read_bytes()


def test_architecture_filled_from_hf_config(tiny_models):
    args = megatron_args(config=hf_config(tiny_models["qwen2"]))
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (2, 128, 256)
    assert (args.num_attention_heads, args.num_query_groups, args.kv_channels) == (4, 2, 32)
    assert (args.rotary_base, args.norm_epsilon, args.vocab_size) == (10000.0, 1e-6, 512)
    assert args.add_qkv_bias and not args.qk_layernorm and args.untie_embeddings_and_output_weights
    qwen3 = megatron_args(config=hf_config(tiny_models["qwen3-tied"]))
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias and not qwen3.untie_embeddings_and_output_weights
    # A given flag that agrees with the config is fine.
    assert megatron_args(["--num-layers", "2", "--add-qkv-bias"], hf_config(tiny_models["qwen2"])).num_layers == 2


@pytest.mark.parametrize("argv, flag, given, config_value", [
    (["--num-layers", "4"], "--num-layers", "4", "2"),
    (["--rotary-base", "1000000"], "--rotary-base", "1000000.0", "10000.0"),
    (["--qk-layernorm"], "--qk-layernorm", "True", "False"),
])
def test_architecture_flag_contradicting_config_is_an_error(tiny_models, argv, flag, given, config_value):
    with pytest.raises(ValueError) as err:
        megatron_args(argv, hf_config(tiny_models["qwen2"]))
    assert flag in str(err.value) and given in str(err.value) and config_value in str(err.value)


def test_llama3_rope_scaling_is_read_and_checked(tiny_models):
    args = megatron_args(config=hf_config(tiny_models["llama3"]))
    assert args.rotary_base == 500000.0 and args.use_rope_scaling and args.rope_scaling_factor == 8.0
    assert args.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}
    assert megatron_args(["--use-rope-scaling", "--rope-scaling-factor", "8"],
                         hf_config(tiny_models["llama3"])).use_rope_scaling  # Megatron-LM's flags, agreeing
    with pytest.raises(ValueError, match="--rope-scaling-factor=32.0 contradicts"):
        megatron_args(["--rope-scaling-factor", "32"], hf_config(tiny_models["llama3"]))
    with pytest.raises(ValueError, match="--use-rope-scaling=True contradicts"):
        megatron_args(["--use-rope-scaling"], hf_config(tiny_models["qwen2"]))


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "longrope", "factor": 4.0}, r"rope_parameters.rope_type 'longrope' is not supported; supported: \('default', "
                                               r"'llama3', 'linear'\)"),
    ({"rope_type": "llama3", "factor": 8.0}, r"lacks \['low_freq_factor', 'high_freq_factor', "
                                             r"'original_max_position_embeddings'\]"),
])
def test_unsupported_rope_is_refused_naming_the_key(tiny_models, rope, match):
    from vime.trainer.megatron.hf_architecture import hf_architecture

    config = hf_config(tiny_models["llama"])
    config.rope_parameters = {**rope, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=match):
        hf_architecture(config)


@pytest.mark.parametrize("argv, world_size, match", [
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2, "--global-batch-size 6 must be a multiple"),
    (["--tensor-model-parallel-size", "8"], 8, "attention heads"),
    (["--pipeline-model-parallel-size", "4"], 4, "layers are not divisible"),
    (["--tensor-model-parallel-size", "2"], 3, "not a multiple of tensor x pipeline"),
    (["--bf16", "--fp16"], None, "exclusive"),
])
def test_validation_errors_say_how_to_fix(tiny_models, argv, world_size, match):
    args = megatron_args(argv, hf_config(tiny_models["qwen2"]))
    with pytest.raises(ValueError, match=match):
        validate_megatron_args(args, world_size)


def test_validation_fills_global_batch_size(tiny_models):
    args = megatron_args(["--micro-batch-size", "2", "--tensor-model-parallel-size", "2"],
                         hf_config(tiny_models["qwen2"]))
    assert validate_megatron_args(args, world_size=8).global_batch_size == 8  # 2 x DP 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is off when CUDA is available")
def test_cpu_layer_is_idempotent_and_scoped_to_megatron(megatron_world):
    from vime.trainer.megatron.cpu_compat import apply_cpu_compat

    depth = torch._C._len_torch_function_stack()
    apply_cpu_compat()
    assert torch._C._len_torch_function_stack() == depth
    assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert torch.zeros(1).type() == "torch.FloatTensor"  # only callers inside megatron see a CUDA type name
    # MoE's token dispatcher orders copies with a side stream: on CPU streams and events are no-ops, and
    # torch.cuda.Stream stays a class (transformers annotates with `torch.cuda.Stream | None` at import)
    assert (torch.cuda.Stream | None) is not None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    side.record_event().synchronize()
    with torch.cuda.stream(side):
        assert torch.ones(2).sum().item() == 2.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is off when CUDA is available")
def test_cpu_layer_runs_a_megatron_training_step(tiny_models, megatron_world):
    """DDP (overlapped reduce) + distributed optimizer + grad clipping: the CUDA-only paths the CPU layer covers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from vime.trainer.megatron.model_provider import build_model_chunks

    path = tiny_models["qwen3"]
    model = build_model_chunks(megatron_args(config=hf_config(path)))
    load_hf_checkpoint_into_model(model, path)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=True)
    model = [DistributedDataParallel(model[0].config, ddp_config, model[0])]
    model[0].config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, use_distributed_optimizer=True), model)
    before = [p.detach().clone() for p in model[0].parameters()]
    tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        loss = chunk(batch, torch.arange(batch.shape[1]).expand_as(batch), attention_mask=None, labels=batch)
        return loss, lambda out: (out.mean(), {"loss": out.mean().detach()})

    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=model,
                                num_microbatches=1, seq_length=12, micro_batch_size=2, forward_only=False)
    updated, grad_norm, _ = optimizer.step()
    assert updated and 0 < grad_norm < float("inf")
    assert all(not torch.equal(a, b) for a, b in zip(before, model[0].parameters()))


@pytest.mark.parametrize("change, match", [
    ({"scoring_func": "softmax"}, r"scoring_func 'softmax' is not supported for deepseek_v3; supported: 'sigmoid'"),
    ({"topk_method": "greedy"}, r"topk_method 'greedy' is not supported for deepseek_v3; supported: 'noaux_tc'"),
    ({"norm_topk_prob": False}, r"norm_topk_prob=False is not supported for deepseek_v3"),
    ({"topk_group": 2}, r"num_experts_per_tok 2 with topk_group 2"),
    ({"n_group": 3}, r"n_group 3 does not divide n_routed_experts 4"),
    ({"rope_interleave": False}, r"rope_interleave=False is not supported for deepseek_v3"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}},
     r"rope_type 'llama3' is not supported; supported: \('default', 'yarn'\) \(multi-latent attention\)"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                          "attention_factor": 2.0, "rope_theta": 10000.0}},
     r"rope_parameters.attention_factor 2.0 is not supported for YaRN; supported: None"),
])
def test_unsupported_deepseek_v3_keys_are_refused_naming_the_key(tiny_models, change, match):
    from vime.trainer.megatron.hf_architecture import hf_architecture

    config = hf_config(tiny_models["deepseek_v3"])
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match):
        hf_architecture(config)


def test_deepseek_v3_architecture_and_mtp_layers(tiny_models, megatron_world, caplog):
    """The DeepSeek-V3 config's MLA and router read into Megatron's flag names; the checkpoint's declared
    multi-token-prediction layer is skipped with a log line, and stored MTP tensors are not read."""
    import logging
    import shutil

    from safetensors.torch import save_file

    from vime.trainer.megatron.model_provider import build_model_chunks

    path = tiny_models["deepseek_v3"]
    args = megatron_args(config=hf_config(path))
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank) == (True, 64, 512)
    assert (args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim, args.kv_channels) == (32, 64, 32, 32)
    assert args.moe_layer_freq == [0, 1] and args.num_experts == 4 and args.moe_router_topk == 2
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert args.moe_shared_expert_intermediate_size == 64 and args.qk_layernorm
    assert args.rope_scaling == {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096.0,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    with pytest.raises(ValueError, match="--q-lora-rank=32 contradicts the HF config, which gives 64"):
        megatron_args(["--q-lora-rank", "32"], hf_config(path))

    with_mtp = path.parent / "deepseek_v3-mtp"
    shutil.copytree(path, with_mtp)
    hf = load_file(with_mtp / "model.safetensors")
    hf["model.layers.2.eh_proj.weight"] = torch.zeros(128, 256)  # an MTP layer's tensor, as DeepSeek stores it
    save_file(hf, with_mtp / "model.safetensors")
    model = build_model_chunks(args)
    with caplog.at_level(logging.INFO):
        load_hf_checkpoint_into_model(model, with_mtp)
    assert "1 multi-token-prediction layer(s) (num_nextn_predict_layers) are not loaded" in caplog.text


def test_glm4_moe_architecture_and_slime_flags(tiny_models):
    """GLM-4.5's config reads into Megatron's flag names, and the architecture flags of slime's GLM-4.5 script
    agree with it (its --moe-router-pre-softmax is moot for sigmoid scores, which Megatron reads only for softmax)."""
    config = hf_config(tiny_models["glm4_moe"])
    args = megatron_args(config=config)
    assert (args.rotary_percent, args.kv_channels, args.add_qkv_bias, args.qk_layernorm) == (0.5, 32, True, True)
    assert args.moe_layer_freq == [0, 1] and args.num_experts == 4 and args.moe_router_topk == 2
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (args.moe_router_num_groups, args.moe_router_topk_scaling_factor) == (None, 2.5)
    assert args.moe_shared_expert_intermediate_size == 64 and not args.multi_latent_attention
    assert not megatron_args(config=hf_config(tiny_models["glm4_moe-air"])).qk_layernorm
    slime = ["--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--kv-channels", "32",
             "--add-qkv-bias", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-percent",
             "0.5", "--swiglu", "--untie-embeddings-and-output-weights", "--moe-router-pre-softmax",
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-"
             "factor", "2.5", "--moe-layer-freq", "[0, 1]", "--moe-shared-expert-intermediate-size", "64"]
    assert megatron_args(slime, config).rotary_percent == 0.5
    with pytest.raises(ValueError, match="--rotary-percent=1.0 contradicts the HF config, which gives 0.5"):
        megatron_args(["--rotary-percent", "1.0"], config)


@pytest.mark.parametrize("change, match", [
    ({"norm_topk_prob": False}, r"norm_topk_prob=False is not supported for glm4_moe"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3}},
     r"partial_rotary_factor 0.3 with head_dim 32: the rotary part must be an even number of dimensions"),
    ({"n_group": 2, "topk_group": 2}, r"num_experts_per_tok 2 with topk_group 2"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
])
def test_unsupported_glm4_moe_keys_are_refused_naming_the_key(tiny_models, change, match):
    from vime.trainer.megatron.hf_architecture import hf_architecture

    config = hf_config(tiny_models["glm4_moe"])
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match):
        hf_architecture(config)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_local_norm_is_built_in_the_models_dtype_and_takes_the_fused_kernel(normalization):
    """Before: the local spec's norms kept float32 weights under bf16 activations; torch then warned "Mismatch dtype
    ... Cannot dispatch to fused implementation" and ran five norms a layer unfused (GPU only: the CPU trainer is
    float32). Same values as the float32 weight: torch's kernel accumulates in float32 either way."""
    import types
    import warnings

    from vime.trainer.megatron.model_provider import LocalNorm

    config = types.SimpleNamespace(normalization=normalization, sequence_parallel=True, params_dtype=torch.bfloat16)
    norm = LocalNorm(config, 64, eps=1e-6)
    assert all(p.dtype == torch.bfloat16 and p.sequence_parallel for p in norm.parameters())
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the unfused path's warning fails the test
        out = norm(x)
    wide = LocalNorm(types.SimpleNamespace(normalization=normalization, sequence_parallel=False,
                                           params_dtype=torch.float32), 64, eps=1e-6)
    wide.load_state_dict({k: v.float() for k, v in norm.state_dict().items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = wide(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=0)


def test_qwen3_next_is_refused_where_it_cannot_run(tiny_models, tmp_path, monkeypatch):
    """vLLM's CPU Gated DeltaNet kernel asserts bfloat16 at the first forward: refused before anything starts,
    naming the flag that fixes it; with it, the model and its layout pass. LoRA on its projections, and the weight
    check across dtypes (bf16 rounding through its recurrent layers exceeds the check's tolerance): refused."""
    from vime.arguments import check_model_args, parse_args

    path = tiny_models["qwen3_next"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    base = ["--hf-checkpoint", str(path), "--prompt-data", str(tmp_path / "p.jsonl"), "--rm-type", "math"]
    with pytest.raises(ValueError, match="CPU engines compute in bfloat16 only, but the engines would run float32: "
                                         "pass --vllm-dtype bfloat16"):
        check_model_args(parse_args(base, check_model=False))
    check_model_args(parse_args([*base, "--vllm-dtype", "bfloat16"], check_model=False))
    with pytest.raises(ValueError, match="--check-weight-update-equal on qwen3_next with bfloat16 engines and a "
                                         "float32 trainer"):
        check_model_args(parse_args([*base, "--vllm-dtype", "bfloat16", "--check-weight-update-equal"],
                                    check_model=False))
    with pytest.raises(ValueError, match="--lora-rank on qwen3_next: LoRA adapters for its Gated DeltaNet"):
        check_model_args(parse_args([*base, "--vllm-dtype", "bfloat16", "--lora-rank", "8"], check_model=False))
    check_model_args(parse_args([*base, "--debug-train-only", "--load-debug-rollout-data", "x_{rollout_id}.pt"],
                                check_model=False))  # no engines
    qwen3_5 = parse_args(["--hf-checkpoint", str(tiny_models["qwen3_5"]), *base[2:], "--vllm-dtype", "bfloat16"],
                         check_model=False)
    if importlib.util.find_spec("torchvision") is not None:  # every install (CPU: scripts/torchvision_cpu.py)
        check_model_args(qwen3_5)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision"
                        else real_find_spec(name, *a))  # an install where torchvision could not be kept
    with pytest.raises(ValueError, match="qwen3_5_text: vLLM's Qwen3.5 model code imports torchvision, which this "
                                         "install lacks"):
        check_model_args(qwen3_5)


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_moe_round_trip_through_tp_and_ep_shards(case, tiny_models):
    """The hybrid MoE layouts split over TP 2 x EP 2: each EP rank holds two of the four experts of every layer, the
    Gated DeltaNet blocks and the gated shared expert split over TP; merged back, the checkpoint bit for bit."""
    path = tiny_models[case]
    config, hf = hf_config(path), load_file(path / "model.safetensors")
    back = {}
    for ep_rank in range(2):
        shards = [hf_to_megatron_state_dict(hf, config, tp_rank, 2, 0, 1, ep_rank, 2) for tp_rank in range(2)]
        assert {k for k in shards[0] if ".local_experts." in k and k.startswith("decoder.layers.0.")} == {
            f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc{f}.weight" for e in range(2) for f in (1, 2)}
        back.update(megatron_to_hf_state_dict(shards, config, 0, 1, ep_rank, 2))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_slime_qwen3_5_script_flags_agree_with_the_hybrid_config(tiny_models, caplog):
    """slime's Qwen3.5 / Qwen3-Next launch scripts: --spec (its layer-spec plugin) is accepted without effect and
    said so, --apply-layernorm-1p (Megatron-LM's name for norms by 1 + weight), --use-gated-attention and
    --attention-output-gate are checked against the config; on a model without them each is refused, naming it."""
    slime = ["--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec", "--disable-bias-linear", "--qk-layernorm",
             "--group-query-attention", "--kv-channels", "32", "--use-gated-attention", "--apply-layernorm-1p",
             "--rotary-percent", "0.25", "--swiglu", "--attention-output-gate", "--untie-embeddings-and-output-weights"]
    for case in ("qwen3_next", "qwen3_5"):
        with caplog.at_level("WARNING"):
            args = megatron_args(slime, hf_config(tiny_models[case]))
        assert args.layernorm_zero_centered_gamma and args.attention_output_gate and args.rotary_percent == 0.25
    assert "--spec has no effect: slime's layer-spec provider" in caplog.text
    for flag, message in (("--apply-layernorm-1p", "--apply-layernorm-1p=True contradicts the HF config"),
                          ("--use-gated-attention", "--use-gated-attention contradicts the HF config"),
                          ("--attention-output-gate", "--attention-output-gate=True contradicts the HF config")):
        with pytest.raises(ValueError, match=message):
            megatron_args([flag], hf_config(tiny_models["qwen3"]))
