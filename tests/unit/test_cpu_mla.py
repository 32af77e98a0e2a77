"""vime's mends of vLLM's CPU path for multi-latent attention (DeepSeek):
- its rotary kernel (`vime.engine.in_vllm.cpu_rope`): 3-D rotary queries [tokens, heads, 64] (a strided slice
  of the full query) with the one shared rotary key [tokens, 1, 64] come out as vLLM's own reference implementation
  (`forward_native`) computes them, in place;
- its attention kernel: a float32 engine gets vLLM's reference MLA backend, since the AMX one (chosen on CPUs with
  AMX) takes bf16/fp16/int8 weights only and killed a float32 DeepSeek engine at start-up."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


def test_patched_cpu_rotary_equals_the_reference_on_3d_inputs():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.platforms import current_platform

    from vime.engine.in_vllm.cpu_rope import patch_cpu_rotary

    if not current_platform.is_cpu():
        pytest.skip("the CPU kernel only")
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=2048, is_neox_style=False, dtype=torch.float32,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    assert patch_cpu_rotary()
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(7)
    query, key = torch.randn(7, 4, 96, generator=g), torch.randn(7, 1, 64, generator=g)  # [nope 32 | rope 64]
    ref_q, ref_k = rope.forward_native(positions, query[..., 32:].clone(), key.clone())
    q, k = query.clone(), key.clone()
    got_q, got_k = rope.forward_cpu(positions, q[..., 32:], k)
    assert torch.allclose(got_q, ref_q, atol=1e-6) and torch.allclose(got_k, ref_k, atol=1e-6)
    assert torch.allclose(q[..., 32:], ref_q, atol=1e-6) and torch.equal(q[..., :32], query[..., :32])  # in place
    assert torch.allclose(k, ref_k, atol=1e-6)
    assert not torch.allclose(ref_q, query[..., 32:])  # the rotation moved them (positions > 0)


def test_a_float32_mla_engine_uses_the_reference_kernel(tiny_qwen3, tmp_path):
    import json
    import shutil

    from vime.arguments import parse_args
    from vime.engine.control.engine import engine_command

    mla = tmp_path / "mla"
    shutil.copytree(tiny_qwen3, mla)
    (mla / "config.json").write_text(json.dumps({**json.loads((tiny_qwen3 / "config.json").read_text()),
                                                 "kv_lora_rank": 32}))
    backend = {}
    for name, model, extra in (("mla", mla, []), ("mla_bf16", mla, ["--vllm-dtype", "bfloat16"]),
                               ("dense", tiny_qwen3, []), ("user", mla, ["--vllm-attention-backend", "AMX_MLA"])):
        argv = ["--hf-checkpoint", str(model), "--debug-train-only", "--load-debug-rollout-data", "unused_{rollout_id}",
                "--rm-type", "math", "--vllm-enforce-eager", "--vllm-dtype", "float32", *extra]
        cmd = engine_command(parse_args(argv, check_model=False), "h", 1, 0)
        backend[name] = cmd[cmd.index("--attention-backend") + 1] if "--attention-backend" in cmd else None
    assert backend == {"mla": "CPU_MLA", "mla_bf16": None, "dense": None, "user": "AMX_MLA"}
