"""The MoE router metrics of a training forward, against values computed by hand from the router's own inputs
(tiny Qwen3-MoE and DeepSeek-V3 on megatron-core, one process, CPU).

- `moe_aux_loss/layer_1`: the Switch load-balancing loss E * sum_e f_e * P_e, with f_e the fraction of the T * k
  routing slots that went to expert e and P_e the mean softmax probability of e (Qwen3-MoE).
- `moe_load_imbalance/layer_1`: the busiest expert's tokens over the mean, from the experts each token was routed
  to (softmax top-k for Qwen3-MoE; sigmoid scores plus the expert bias, group-limited, for DeepSeek-V3); forwards
  without gradients (log-probs) are not counted.
"""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance, to_device_of  # noqa: E402


@pytest.fixture(scope="module")
def megatron_world():
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, seed=1234)
    yield
    destroy_parallel()


def _model(tmp_path, arch: str, argv: list[str]):
    from transformers import AutoConfig

    from vime.trainer.megatron.arguments import add_megatron_args, fill_architecture_from_hf
    from vime.trainer.megatron.hf_checkpoint import load_hf_checkpoint_into_model
    from vime.trainer.megatron.model_provider import build_model_chunks
    from vime.synthetic.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch=arch, seed=11)
    args = add_megatron_args(argparse.ArgumentParser()).parse_args(argv)
    args = fill_architecture_from_hf(args, AutoConfig.from_pretrained(path))
    model = build_model_chunks(args)
    load_hf_checkpoint_into_model(model, path)
    return args, model


def _router_inputs(model) -> dict:
    """Layer index -> the router's input [tokens, hidden] of the last forward."""
    seen = {}
    for name, module in model[0].named_modules():
        if name.endswith("mlp.router"):  # kept on CPU: the hand computations run there
            module.register_forward_pre_hook(
                lambda m, inputs: seen.__setitem__(m.layer_number - 1, inputs[0].detach().flatten(0, -2).cpu()))
    return seen


def _forward(model, with_grad: bool) -> None:
    tokens = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40).expand_as(tokens)
    with torch.set_grad_enabled(with_grad):
        model[0].train()(to_device_of(model, tokens), to_device_of(model, positions), attention_mask=None)


def _imbalance(chosen: torch.Tensor, num_experts: int) -> float:
    counts = torch.bincount(chosen.flatten(), minlength=num_experts).double()
    return (counts.max() / counts.mean()).item()


def test_qwen3_moe_aux_loss_and_load_imbalance_by_hand(tmp_path, megatron_world):
    from vime.trainer.megatron.device import model_device
    from vime.trainer.moe_metrics import ExpertLoad, take_moe_losses

    args, model = _model(tmp_path, "qwen3_moe", ["--moe-aux-loss-coeff", "0.01"])
    load = ExpertLoad(model, args.num_layers, args.num_experts)
    inputs = _router_inputs(model)
    _forward(model, with_grad=False)  # a log-prob forward: no load counted
    assert load.take() == {}
    _forward(model, with_grad=True)
    losses = take_moe_losses(args, num_micro_batches=1, device=model_device(model))  # tensors, read once a step
    metrics = {**{k: v.item() for k, v in losses.items()}, **load.take()}

    x = inputs[1]
    weight = model[0].decoder.layers[1].mlp.router.weight.detach().cpu()
    logits = x @ weight.T  # [T, E]
    tokens, experts, k = logits.shape[0], args.num_experts, args.moe_router_topk
    chosen = logits.topk(k, dim=-1).indices
    f = torch.bincount(chosen.flatten(), minlength=experts).double() / (tokens * k)
    p = torch.softmax(logits.double(), dim=-1).mean(dim=0)
    expected_aux = (experts * (f * p).sum()).item()
    assert metrics["moe_aux_loss/layer_1"] == pytest.approx(expected_aux, abs=output_tolerance("loss", model))
    assert metrics["moe_aux_loss"] == metrics["moe_aux_loss/layer_1"]  # the only MoE layer
    assert 1.0 <= metrics["moe_load_imbalance/layer_1"] == pytest.approx(_imbalance(chosen, experts), abs=1e-9)
    assert "moe_load_imbalance/layer_0" not in metrics  # the dense first layer


def test_deepseek_v3_load_imbalance_follows_the_expert_bias(tmp_path, megatron_world):
    from vime.trainer.moe_metrics import ExpertLoad

    args, model = _model(tmp_path, "deepseek_v3", [])
    load = ExpertLoad(model, args.num_layers, args.num_experts)
    inputs = _router_inputs(model)
    _forward(model, with_grad=True)
    got = load.take()["moe_load_imbalance/layer_1"]

    router = model[0].decoder.layers[1].mlp.router
    weight, expert_bias = router.weight.detach().cpu(), router.expert_bias.cpu()
    scores = torch.sigmoid(inputs[1] @ weight.T) + expert_bias
    groups = scores.view(len(scores), 2, -1).topk(2, dim=-1).values.sum(-1)  # a group: its two best experts
    best_group = groups.argmax(dim=-1)
    in_group = torch.arange(args.num_experts).view(1, 2, -1)[0][best_group]  # [T, experts per group]
    chosen = in_group.gather(1, scores.gather(1, in_group).topk(2, dim=-1).indices)
    assert got == pytest.approx(_imbalance(chosen, args.num_experts), abs=1e-9)
    unbiased = torch.sigmoid(inputs[1] @ weight.T).topk(2, dim=-1).indices  # the bias matters
    assert abs(got - _imbalance(unbiased, args.num_experts)) > 0.01
