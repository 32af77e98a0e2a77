"""Every tensor a training step touches is on the model's device (issue 36): the model's outputs run on `meta`
(tests/helpers/meta_device.py), which refuses CPU operands as CUDA does, and process groups that refuse CPU
tensors stand in for NCCL. Each test here failed on the code before the fix with the error a GPU run showed."""

from __future__ import annotations

import types

import pytest
import torch

from tests.helpers.meta_device import META, NCCL_REFUSES_CPU, assert_all_on, model_output_on_meta, nccl_only
from tests.helpers.trainer_runs import BASE_ARGV

VOCAB = 32
RESPONSE_LENGTHS = [3, 2, 4, 1]


@pytest.fixture
def megatron_world():
    from vime.trainer.megatron.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, seed=1234)
    yield
    destroy_parallel()


def _args(hf_dir, *extra, **values):
    from vime.arguments import parse_args
    from vime.utils.misc import with_values

    args = parse_args(["--hf-checkpoint", str(hf_dir), *BASE_ARGV, *extra])
    return with_values(args, **values) if values else args


def _batch():
    """Four samples with every per-sample field a step may read, on the CPU as the trainer holds them."""
    from vime.trainer.train_batch import TrainBatch

    g = torch.Generator().manual_seed(0)

    def per_token():
        return [-torch.rand(n, generator=g) for n in RESPONSE_LENGTHS]

    batch = TrainBatch(tokens=[list(range(1, 4 + n)) for n in RESPONSE_LENGTHS], response_lengths=RESPONSE_LENGTHS,
                       loss_masks=[torch.ones(n) for n in RESPONSE_LENGTHS], rewards=torch.tensor([1.0, 0, 1, 0]),
                       rollout_log_probs=per_token(), num_usable=4)
    batch.old_log_probs, batch.ref_log_probs, batch.teacher_log_probs = per_token(), per_token(), per_token()
    batch.advantages = [torch.randn(n, generator=g) for n in RESPONSE_LENGTHS]
    batch.returns = [torch.randn(n, generator=g) for n in RESPONSE_LENGTHS]
    batch.old_values = [torch.randn(n, generator=g) for n in RESPONSE_LENGTHS]
    return batch


def _inputs(batch, indices):
    from vime.trainer.batching import micro_batch_inputs

    return micro_batch_inputs([batch.tokens[i] for i in indices], [batch.response_lengths[i] for i in indices])


def advantage_weighted_nll(args, mb, log_probs, entropy, agg):
    """A custom loss as a plugin writes it: the micro-batch's own tensors next to the log-probs."""
    loss = agg([-a * lp for a, lp in zip(mb["advantages"], log_probs)], mb["loss_masks"])
    return loss, {"custom_loss": loss.detach()}


LOSS_VARIANTS = {
    "grpo": ([], {}),
    "tis": (["--use-tis"], {}),
    "mis": (["--use-mis"], {}),
    "kl_loss": (["--use-kl-loss", "--kl-loss-coef", "0.1"], {}),
    "entropy": (["--entropy-coef", "0.01"], {}),
    "opd_loss": ([], {"opd_mode": "loss"}),
    "opd_reward": ([], {"opd_mode": "reward"}),
    "sft": (["--loss-type", "sft_loss"], {}),
    "custom": ([], {"custom_loss_function_path": f"{__name__}.advantage_weighted_nll"}),
}


@pytest.mark.parametrize("variant", list(LOSS_VARIANTS))
def test_policy_loss_takes_the_batch_on_the_models_device(tiny_qwen3, megatron_world, variant):
    """Before: advantages, old / reference / rollout log-probs and a custom loss's batch stayed on the CPU next
    to CUDA log-probs ("Expected all tensors to be on the same device"; here: "... expected device meta")."""
    from vime.trainer.micro_batch_loss import make_loss_fn

    extra, values = LOSS_VARIANTS[variant]
    args = _args(tiny_qwen3, *extra, **values)
    batch = _batch()
    if not variant.startswith("opd"):
        batch.teacher_log_probs = None
    indices = [0, 2, 3]
    inputs = _inputs(batch, indices)
    loss_fn = make_loss_fn(args, batch, {"tokens": 10.0, "sequences": 4}, scale=2.0, step_index=0)
    logits = model_output_on_meta(sum(batch.response_lengths[i] for i in indices), VOCAB)
    loss, metrics = loss_fn(indices, inputs, logits)
    assert loss.device == META and loss.shape == ()
    assert_all_on(metrics.values(), META)  # the step's metrics stay on the model's device until the step ends
    assert {"loss", "entropy", "logprob_diff_sum", "logprob_diff_count", "logprob_diff_max"} <= set(metrics)
    loss.backward()
    assert logits.grad is not None and logits.grad.device == META


def test_rollout_gap_counts_trained_tokens_only():
    """The train/inference gap metric without boolean indexing (no host sync): the same numbers."""
    from vime.trainer.micro_batch_loss import rollout_gap

    lps = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5]), torch.tensor([-4.0, -1.0])]
    rollout = [torch.tensor([-1.5, float("nan"), -3.25]), None, torch.tensor([-4.0, -0.25])]
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0]), torch.tensor([1.0, 1.0])]
    gap = rollout_gap(lps, rollout, masks)
    assert gap["logprob_diff_sum"].item() == pytest.approx(0.5 + 0.25 + 0.0 + 0.75)
    assert gap["logprob_diff_count"].item() == 4.0
    assert gap["logprob_diff_max"].item() == pytest.approx(0.75)
    assert rollout_gap(lps, [None, None, None], masks)["logprob_diff_count"].item() == 0.0


def test_value_loss_takes_masks_old_values_and_returns_on_the_models_device(tiny_qwen3, megatron_world):
    """Before: the critic's loss masks, old values and returns stayed on the CPU next to CUDA values."""
    from vime.trainer.critic import make_value_loss_fn

    args = _args(tiny_qwen3, "--advantage-estimator", "ppo")
    batch = _batch()
    indices = [1, 2]
    loss_fn = make_value_loss_fn(args, batch, {"tokens": 6.0, "sequences": 2}, scale=1.0)
    values = model_output_on_meta(sum(batch.response_lengths[i] for i in indices), 1)
    loss, metrics = loss_fn(indices, _inputs(batch, indices), values)
    assert loss.device == META
    assert_all_on(metrics.values(), META)
    loss.backward()
    assert values.grad.device == META


class _LastStage(torch.nn.Module):
    """A last pipeline stage as `attach_value_head` sees it: its LM head where the model was put, in its dtype."""

    post_process = True

    def __init__(self, device, dtype):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=8)
        self.embedding = torch.nn.Embedding(VOCAB, 8, device=device, dtype=dtype)
        self.output_layer = torch.nn.Linear(8, VOCAB, bias=False, device=device, dtype=dtype)
        self.share_embeddings_and_output_weights = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_head_is_made_where_the_model_is_and_in_its_dtype(dtype):
    """Before: the value head was created on the CPU in float32 after the model had moved to the GPU (fp32:
    forward fails; bf16: F.linear of bf16 input and fp32 weight, or Megatron's Float16 optimizer refuses it)."""
    from vime.trainer.critic import attach_value_head

    chunk = _LastStage(META, dtype)
    attach_value_head([chunk])
    head = chunk.output_layer
    assert (head.weight.device, head.weight.dtype, tuple(head.weight.shape)) == (META, dtype, (1, 8))
    assert not chunk.share_embeddings_and_output_weights
    values, _ = head(torch.empty(5, 1, 8, device=META, dtype=dtype))
    assert (values.device, values.dtype, tuple(values.shape)) == (META, dtype, (5, 1, 1))
    cpu = _LastStage("cpu", torch.float32)
    attach_value_head([cpu])
    assert torch.equal(cpu.output_layer.weight, torch.zeros(1, 8))  # zero-initialised: the first values are 0


def _fake_trainer(dp_size: int, device, **more):
    return types.SimpleNamespace(dp_size=dp_size, device=torch.device(device), **more)


def test_reduce_all_reduces_on_the_device_an_nccl_group_serves(megatron_world, monkeypatch):
    """Before: the metric sums were built on the CPU and all-reduced over the data-parallel group, which on GPUs
    is NCCL only ("No backend type associated with device type cpu"): every run with data parallel > 1 died
    after its first step."""
    from megatron.core import parallel_state

    from vime.trainer import step_metrics

    group = parallel_state.get_data_parallel_group()
    monkeypatch.setattr(step_metrics, "is_last_stage", lambda: True)
    # a custom loss may report a metric as a CPU tensor or a number: the reduction places it
    mb_metrics = [{"loss": torch.tensor(0.5), "logprob_diff_max": torch.tensor(0.25), "custom": 1.0},
                  {"loss": torch.tensor(0.25), "logprob_diff_max": torch.tensor(0.75), "custom": 2.0}]
    with nccl_only(group) as reduced:
        out = step_metrics.reduce_step_metrics(mb_metrics, 2, META)
    assert sorted(out) == ["custom", "logprob_diff_max", "loss"]
    assert_all_on(out.values(), META)
    assert [(d.type, op) for d, op in reduced] == [("meta", dist_op("SUM")), ("meta", dist_op("MAX"))]


def dist_op(name: str):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


def test_reduce_sums_shares_and_takes_the_max_over_a_gloo_group(megatron_world, monkeypatch):
    """On a gloo group (CPU runs) the metrics are reduced on the CPU, with data parallel forced to 2 (a group of
    one: the all-reduce runs and leaves the sums); read once, as floats."""
    from vime.trainer import step_metrics
    from vime.trainer.step_metrics import read_metrics

    monkeypatch.setattr(step_metrics, "is_last_stage", lambda: True)
    mb_metrics = [{"loss": torch.tensor(0.5), "logprob_diff_max": torch.tensor(0.25), "custom": 1.0},
                  {"loss": torch.tensor(0.25), "logprob_diff_max": torch.tensor(0.75), "custom": 2.0}]
    out = step_metrics.reduce_step_metrics(mb_metrics, 2, "cpu")
    assert_all_on(out.values(), "cpu")
    assert read_metrics({**out, "lr": 1e-3}) == {"custom": 3.0, "logprob_diff_max": 0.75, "loss": 0.75, "lr": 1e-3}


def test_collective_device_follows_the_groups_backend(megatron_world):
    """gloo takes CPU tensors; an NCCL-only group takes the rank's own device's."""
    from megatron.core import parallel_state

    from vime.trainer.megatron.device import backend_takes_cpu, collective_device

    group = parallel_state.get_data_parallel_group()
    assert collective_device(group, META) == torch.device("cpu")  # this machine's groups are gloo
    with nccl_only(group):
        assert collective_device(group, META) == META
    assert [backend_takes_cpu(b) for b in ("gloo", "nccl", "cpu:gloo,cuda:nccl")] == [True, False, True]


def test_moe_tracker_stand_in_is_on_the_models_device(megatron_world):
    """Before: a stage without MoE layers (DeepSeek-V3's dense first layers under pipeline parallel) added a CPU
    tensor to Megatron's aux-loss tracker, which megatron-core all-reduces over the pipeline group (NCCL)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from vime.trainer.trainer import MegatronTrainer

    get_moe_layer_wise_logging_tracker().clear()
    args = types.SimpleNamespace(num_experts=4, moe_layer_freq=[0, 1, 1], moe_aux_loss_coeff=0.01,
                                 moe_router_load_balancing_type="aux_loss", moe_z_loss_coeff=None)
    no_expert_load = types.SimpleNamespace(take=dict)
    trainer = _fake_trainer(1, META, args=args, expert_load=no_expert_load)
    groups = {parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_data_parallel_group()}
    try:
        with nccl_only(*groups) as reduced:
            metrics = MegatronTrainer._moe_metrics(trainer, 2)
    finally:
        clear_aux_losses_tracker()
        get_moe_layer_wise_logging_tracker().clear()
    assert sorted(metrics) == ["moe_aux_loss", "moe_aux_loss/layer_1", "moe_aux_loss/layer_2"]
    assert_all_on(metrics.values(), META)
    assert reduced and all(d == META for d, _ in reduced)


def test_moe_losses_average_over_moe_layers_and_micro_batches(megatron_world):
    """The numbers behind the metrics above, on the CPU: the tracker's per-layer sums over micro-batches."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from vime.trainer.moe_metrics import take_moe_losses

    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()
    args = types.SimpleNamespace(num_experts=4, moe_layer_freq=[0, 1, 1], moe_aux_loss_coeff=0.01,
                                 moe_router_load_balancing_type="aux_loss", moe_z_loss_coeff=None)
    tracker["load_balancing_loss"] = {"values": torch.tensor([0.0, 2.0, 4.0]), "reduce_group": None,
                                      "avg_group": None, "reduce_group_has_dp": False}
    try:
        out = take_moe_losses(args, 2, "cpu")
    finally:
        clear_aux_losses_tracker()
        tracker.clear()
    assert {k: v.item() for k, v in out.items()} == {"moe_aux_loss": 1.5, "moe_aux_loss/layer_1": 1.0,
                                                     "moe_aux_loss/layer_2": 2.0}


def _adam_on(device, fused: bool):
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    adam = torch.optim.Adam([param])
    adam.param_groups[0].update(fused=fused, foreach=False)  # as `use_fused_adam` switches it
    adam.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                         "exp_avg_sq": torch.zeros_like(param)}
    return param, adam


def test_distributed_optimizer_load_puts_fused_adam_steps_with_the_parameters():
    """Before: after a DistributedOptimizer load each parameter's `step` was a new CPU tensor, which fused AdamW
    on a GPU refuses at the next step (checkpoint save -> load -> step failed on the H200)."""
    from vime.trainer.megatron.checkpoint import _restore_adam_steps

    param, adam = _adam_on(META, fused=True)
    optimizer = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=adam)])
    loaded = {"optimizer": {"param_groups": [{"step": 3}]}}
    _restore_adam_steps(optimizer, loaded)
    step = adam.state[param]["step"]
    assert (step.device, step.dtype) == (META, torch.float32)
    cpu_param, cpu_adam = _adam_on("cpu", fused=False)
    _restore_adam_steps(types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=cpu_adam)]),
                        loaded)
    assert cpu_adam.state[cpu_param]["step"].item() == 3.0  # the checkpoint's step, where the kernel reads it


def test_a_cpu_saved_adam_state_resumes_with_fused_steps_on_the_parameters_device():
    """A checkpoint saved by a run whose Adam kept `step` on the CPU (a non-fused kernel), loaded into a model on
    another device whose Adam is then switched to the fused kernel: each `step` moves to its parameter."""
    from vime.trainer.megatron.checkpoint import place_adam_steps
    from vime.trainer.megatron.model import use_fused_adam

    _, saved = _adam_on("cpu", fused=False)
    saved.state[saved.param_groups[0]["params"][0]]["step"] = torch.tensor(7.0)
    param, adam = _adam_on(META, fused=False)
    adam.state.clear()
    adam.load_state_dict(saved.state_dict())  # torch keeps a non-fused group's step where it was saved
    assert adam.state[param]["step"].device == torch.device("cpu")
    optimizer = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=adam)])
    use_fused_adam(optimizer)
    place_adam_steps(optimizer)
    assert adam.state[param]["step"].device == META
    _, unfused = _adam_on("cpu", fused=False)
    unfused.state[unfused.param_groups[0]["params"][0]]["step"] = torch.tensor(7.0)
    place_adam_steps(types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=unfused)]))
    assert next(iter(unfused.state.values()))["step"].item() == 7.0


def test_nccl_only_refuses_cpu_tensors_like_nccl(megatron_world):
    """The harness itself: a CPU tensor raises NCCL's error, a meta one is taken; other groups are untouched."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    with nccl_only(group) as reduced:
        with pytest.raises(RuntimeError, match=NCCL_REFUSES_CPU):
            dist.all_reduce(torch.ones(2), group=group)
        dist.all_reduce(torch.ones(2, device=META), group=group)
        t = torch.ones(2)
        dist.all_reduce(t)  # the default group: the real gloo one
    assert reduced == [(META, dist.ReduceOp.SUM)] and t.tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="expected device meta"):
        torch.ones(3, device=META) * torch.ones(3)
    assert (torch.ones(3, device=META) * torch.tensor(2.0)).device == META  # 0-dim CPU scalars pass, as on CUDA


def test_broadcast_backend_is_picked_by_each_member_for_its_own_device(tiny_qwen3, monkeypatch):
    """Before: the driver wrote "nccl" or "gloo" into the handle from its own `use_gpu()`, so a driver on a
    CPU-only head node told GPU trainers and engines to broadcast CUDA tensors over gloo."""
    import vime.utils.device
    from vime.transport.weights.base import DriverSetup
    from vime.transport.weights.broadcast.driver import BroadcastDriver
    from vime.engine.protocol.weight_broadcast import group_backend

    monkeypatch.setattr(vime.utils.device, "use_gpu", lambda: False)  # the driver: a CPU-only head node
    transport = BroadcastDriver(DriverSetup.of(_args(tiny_qwen3, "--update-weight-transport", "broadcast")))
    transport.connect(["http://engine"], lambda: ("127.0.0.1", 29500))
    handle = transport.prepare(version=1)
    method, kwargs = transport.load_calls(["http://engine"], handle)["http://engine"]
    assert method == "vime_receive_weights"
    assert handle.get("backend") is None and kwargs.get("backend") is None
    # (as strings: in a process with vime's CPU layer for Megatron, torch.device("cuda") is redirected to the CPU)
    assert [group_backend(d) for d in ("cuda:0", "cuda", "cpu", META)] == ["nccl", "nccl", "gloo", "gloo"]


class _Remote:
    """A Ray actor method as `check_weights_equal` calls it (`.remote(...)`), answering at once."""

    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args, **kwargs):
        return self.answer


def test_weight_check_holds_gpu_trainers_to_their_tolerance_on_a_cpu_only_driver(monkeypatch):
    """Before: the driver chose the tolerance from its own devices, so a CPU-only head node held bf16 GPU trainers
    and engines to CPU float32's 1e-5 and failed every weight update they made correctly (a gap of 1e-3)."""
    import vime.utils.deadline
    import vime.utils.device
    from vime.transport.weights.check import WeightUpdateMismatchError, check_weights_equal

    monkeypatch.setattr(vime.utils.device, "use_gpu", lambda: False)  # the driver
    monkeypatch.setattr(vime.utils.deadline, "control", lambda answer, what: answer)
    args = types.SimpleNamespace(bf16=True, fp16=False, vllm_dtype=None, lora_adapters=None)
    trainer_lps = [-1.0, -2.0]

    def group(kind):
        return types.SimpleNamespace(compute_kind=lambda: kind,
                                     probe_log_probs=lambda *a, **k: [trainer_lps])

    manager = types.SimpleNamespace(probe_tokens=_Remote([1, 2, 3]), get_engine_urls=_Remote(["http://e"]),
                                    probe_log_probs=_Remote([[-1.0, -2.0 + 1e-3]]))
    worst = check_weights_equal(args, group(("bfloat16", "cuda")), manager)
    assert worst["weight_check/max_abs_logprob_diff"] == pytest.approx(1e-3)
    with pytest.raises(WeightUpdateMismatchError):  # the same gap from CPU float32 trainers is a real mismatch
        check_weights_equal(args, group(("float32", "cpu")), manager)
