"""One Gated DeltaNet layer (Qwen3-Next's linear attention), forward + backward: vime's trainer layer against
transformers' own implementation of the same shape and weights, side by side in one run, on this machine's CPUs.

    .venv/bin/python bench/gated_delta_net.py [--seq 2048] [--batch 1] [--repeats 3]

The shape is Qwen3-Next-80B-A3B's: hidden 2048, 16 key heads and 32 value heads of 128, convolution kernel 4.
transformers runs its reference torch path (flash-linear-attention and causal-conv1d need CUDA), which is what a
CPU user of transformers gets. Printed: seconds per forward + backward of each, the ratio vime / transformers
(issue 52 asks for <= 1.0), and the largest output difference (the two compute the same function). Also the bare
rule alone (vime's chunked rule against transformers' `torch_chunk_gated_delta_rule`). A benchmark, never a timed
test.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPE = dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4)


def _timed(step, repeats: int) -> float:
    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def _layers():
    """transformers' Qwen3NextGatedDeltaNet and vime's GatedDeltaNetAttention holding the same weights."""
    from megatron.core.transformer import TransformerConfig
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from vime.trainer.megatron.hf_conversion import Arch, _Param, _to_full_megatron
    from vime.trainer.megatron.linear_attention import GatedDeltaNetAttention
    from vime.trainer.megatron.parallel import init_parallel

    init_parallel(1, 1, seed=0)
    hf_config = Qwen3NextConfig(num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_hidden_layers=1,
                                layer_types=["linear_attention"], **SHAPE)
    torch.manual_seed(0)
    theirs = Qwen3NextGatedDeltaNet(hf_config, 0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    config = TransformerConfig(num_layers=1, hidden_size=SHAPE["hidden_size"], num_attention_heads=16,
                               use_cpu_initialization=True, layernorm_epsilon=hf_config.rms_norm_eps,
                               **{k: v for k, v in SHAPE.items() if k != "hidden_size"})
    ours = GatedDeltaNetAttention(config)
    arch = Arch(1, 16, 2, 256, False, True, False, linear_layers=(1,),
                linear_heads=(16, 32, 128, 128))
    weights = {f"linear_attn.{n}": t for n, t in theirs.state_dict().items()}
    in_proj = _to_full_megatron(_Param("gdn_in", ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"),
                                       0), weights, arch)
    with torch.no_grad():
        ours.in_proj.weight.copy_(in_proj)
        ours.conv1d_weight.copy_(theirs.conv1d.weight)
        ours.dt_bias.copy_(theirs.dt_bias)
        ours.A_log.copy_(theirs.A_log)
        ours.out_norm_weight.copy_(theirs.norm.weight)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
    return theirs, ours


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    theirs, ours = _layers()
    x = torch.randn(a.batch, a.seq, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))

    def step(layer, sbh: bool):
        inp = (x.transpose(0, 1) if sbh else x).detach().requires_grad_()
        out = layer(inp)[0] if sbh else layer(inp)
        out.float().square().mean().backward()
        return out.transpose(0, 1) if sbh else out

    with torch.no_grad():
        gap = (ours(x.transpose(0, 1))[0].transpose(0, 1) - theirs(x)).abs().max().item()
    t_theirs = _timed(lambda: step(theirs, False), a.repeats)
    t_ours = _timed(lambda: step(ours, True), a.repeats)
    print(f"Gated DeltaNet layer, batch {a.batch} x {a.seq} tokens, Qwen3-Next-80B-A3B's shape, "
          f"{torch.get_num_threads()} threads")
    print(f"  transformers forward+backward {t_theirs:.3f} s; vime {t_ours:.3f} s; vime / transformers "
          f"{t_ours / t_theirs:.2f}; max |output difference| {gap:.2e}")

    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from vime.trainer.megatron.gated_delta_rule import chunked_gated_delta_rule, l2_normalize

    g = torch.Generator().manual_seed(2)
    q, k = (l2_normalize(torch.randn(a.batch, a.seq, 32, 128, generator=g)) for _ in range(2))
    v = torch.randn(a.batch, a.seq, 32, 128, generator=g)
    decay, beta = -torch.rand(a.batch, a.seq, 32, generator=g), torch.rand(a.batch, a.seq, 32, generator=g)

    def rule(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, decay, beta)]
        fn(*leaves, **kw)[0].square().mean().backward()

    t_theirs = _timed(lambda: rule(lambda *t: torch_chunk_gated_delta_rule(*t[:3], g=t[3], beta=t[4])), a.repeats)
    t_ours = _timed(lambda: rule(chunked_gated_delta_rule), a.repeats)
    print(f"  the rule alone: transformers {t_theirs:.3f} s; vime {t_ours:.3f} s; vime / transformers "
          f"{t_ours / t_theirs:.2f}")


if __name__ == "__main__":
    main()
