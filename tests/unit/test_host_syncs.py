"""No host sync per micro-batch: whole `MegatronTrainer` rollouts (Megatron-core on gloo, this CPU) under
`tests/helpers/host_sync_guard.py`, which records every place where a GPU step would make the host wait for the
device: a device value read back (`.item()`, `bool()`, `.tolist()`, `.cpu()`, `nonzero`, boolean-mask indexing,
...) and a blocking host-to-device copy. `torch.cuda.set_sync_debug_mode("error")` raises at each of these on CUDA;
the guard tells device from host tensors on the CPU by where they came from (the trainer's parameters, gradients and
optimizer state, what is uploaded or made on the device, and everything computed from them).

The syncs a rollout may make are listed below by name (the innermost vime or megatron-core frame and the kind), each
with its count per unit (an optimizer step, a forward-only pass, ...) and why it stays; a rollout must make exactly
those, no other, and the same number whether its steps run 4 or 2 micro-batches each. Only Megatron-core's own MoE
token dispatch syncs per micro-batch (per MoE layer and forward), as it does on a GPU.

Covered: dense LoRA with shared prompts on and off (and padded micro-batches, and a per-sequence loss mean), two
steps per rollout (the old-log-prob pass) and a KL loss (the reference's pass); MoE with the trainer's own routing replay and with the
engine's; the PPO critic (its values pass and its steps); MTP layers trained beside the policy. The guard itself fails on a deliberate read of a device
value inside a step, and not on a host one.
"""

from __future__ import annotations

import sys
import textwrap
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.host_sync_guard import HostSyncGuard, trainer_device_tensors  # noqa: E402
from tests.helpers.rollouts import flat, make_rollout  # noqa: E402
from tests.helpers.trainer_runs import local_trainer  # noqa: E402
from vime.utils.misc import with_values  # noqa: E402

# name: (unit, count per unit, why it stays)
ALLOWED = {
    "megatron.core.optimizer.clip_grads:get_grad_norm_fp32 item":
        ("step", 1, "Megatron's gradient clipping reads the global gradient norm (it scales by it, and reports it)"),
    "vime.trainer.non_finite:_any_rank tolist":
        ("step", 1, "whether a loss or gradient is NaN or inf on any rank: the host decides to skip the step"),
    "vime.trainer.non_finite:check_finite_parameters tolist":
        ("step", 1, "whether the step left a parameter non-finite: the run stops before such weights leave"),
    "vime.trainer.moe_metrics:ExpertLoad.take download":
        ("MoE step", 1, "the step's tokens per expert, for the load-imbalance metrics"),
    "vime.trainer.passes:OnHost.gather download":
        ("pass", 1, "a forward-only pass's log-probs (or the critic's values) to the host, once when it ends"),
    "vime.trainer.routing_replay:RoutingReplay._store_recorded download":
        ("recording pass", 1, "the routing the old-log-prob pass recorded (--use-routing-replay), once when it ends"),
    "vime.trainer.step_metrics:read_metrics tolist":
        ("rollout", 1, "the rollout's metrics, read once when it ends"),
    "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize "
    "stream synchronize":
        ("MoE layer forward", 1, "Megatron's dropless dispatch: the tokens per expert reach the host to split the "
                                 "expert GEMMs (as on a GPU)"),
    "megatron.core.transformer.moe.moe_utils:permute masked_select":
        ("MoE layer forward", 2, "Megatron's unfused permutation selects each expert's tokens and probabilities "
                                 "(--moe-permute-fusion needs TransformerEngine)"),
}
PER_MICRO_BATCH = {"MoE layer forward"}  # Megatron-core's, not vime's


def expected_syncs(units: dict[str, int]) -> Counter:
    """The syncs a run of `units` ({unit: how many}) may make, by name."""
    return Counter({name: count * units.get(unit, 0) for name, (unit, count, _) in ALLOWED.items()})


def assert_syncs(guard: HostSyncGuard, units: dict[str, int]) -> Counter:
    """The run made exactly the allowed syncs for `units`: nothing else (named in the failure) and no more."""
    seen, allowed = guard.counts(), expected_syncs(units)
    offending = {name: n for name, n in seen.items() if name not in ALLOWED}
    assert not offending, f"host syncs not allowed in a training step: {offending}"
    assert +seen == +allowed, f"allowed syncs in other numbers than {units}: seen {dict(seen)}, expected " \
                              f"{dict(+allowed)}"
    return seen


def per_step_syncs(counts: Counter) -> Counter:
    return Counter({name: n for name, n in counts.items() if ALLOWED[name][0] not in PER_MICRO_BATCH})


def rollout_units(t, groups, moe_layers: int = 0, recording: bool = False) -> dict[str, int]:
    """What an actor's `train(rollout_id, groups)` just ran: its steps, forward-only passes and forwards."""
    from vime.trainer.train_batch import TrainBatch

    plan = t._split(TrainBatch.from_samples(groups, t.args))
    micro_batches = sum(len(mbs) for _, _, mbs in plan)
    return {"step": len(plan), "pass": t.forward_passes, "rollout": 1, "recording pass": int(recording),
            "MoE step": len(plan) if moe_layers else 0, "micro-batch": micro_batches,
            "MoE layer forward": moe_layers * micro_batches * (t.forward_passes + 1)}


def train_guarded(t, guard, groups, micro_batch_size: int, **values) -> dict[str, int]:
    """One rollout (two steps of 2 or 4 micro-batches each) under `guard`, its events alone kept; its units."""
    t.args = with_values(t.args, micro_batch_size=micro_batch_size, **values)
    guard.events.clear()
    t.train(1, groups)
    units = rollout_units(t, groups, moe_layers=len(t.expert_load.moe_layers) if t.expert_load is not None else 0,
                          recording=t.args.use_routing_replay)
    assert units["step"] == 2 and units["micro-batch"] == 16 // micro_batch_size
    return units


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from vime.synthetic.tiny_model import build_tiny_model

    # every layer an MoE layer
    return build_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", seed=0, config={"mlp_only_layers": []})


# 16 samples, --global-batch-size 8: two optimizer steps per rollout, so the old log-probs are computed
TWO_STEPS = ["--global-batch-size", "8"]


PLAIN = {"share_group_prompts": False, "qkv_format": "thd", "loss_agg_mode": "token_mean"}
SETTINGS = {"shared prompts": {**PLAIN, "share_group_prompts": True}, "packed": PLAIN,
            "padded": {**PLAIN, "qkv_format": "bshd"},
            "per-sequence loss": {**PLAIN, "loss_agg_mode": "seq_mean_token_mean"}}  # GSPO / DAPO-style means


def test_dense_lora_steps_sync_per_step_only_with_and_without_shared_prompts(tiny_qwen3):
    from vime.trainer.passes import prompt_sharing

    groups = make_rollout(seed=5)
    with local_trainer(tiny_qwen3, *TWO_STEPS, "--lora-rank", "4", "--use-kl-loss", "--kl-loss-coef", "0.01") as t, \
            HostSyncGuard(trainer_device_tensors(t)) as guard:
        assert t.lora is not None
        runs = {}
        for setting, size in [("shared prompts", 4), ("shared prompts", 2), ("packed", 4), ("packed", 2),
                              ("padded", 2), ("per-sequence loss", 2)]:
            units = train_guarded(t, guard, groups, size, **SETTINGS[setting])
            assert (prompt_sharing(t.args, t.model) is None) == (setting == "shared prompts")
            assert t.forward_passes == 2  # the old log-probs, the reference's
            runs[setting, size] = assert_syncs(guard, units)
    first = runs["shared prompts", 4]
    assert all(counts == first for counts in runs.values()), runs  # the same syncs, whatever the micro-batches


def test_moe_steps_with_routing_replay_sync_per_step_but_for_megatrons_dispatch(tiny_moe):
    groups = make_rollout(seed=5)
    with local_trainer(tiny_moe, *TWO_STEPS, "--use-routing-replay") as t, \
            HostSyncGuard(trainer_device_tensors(t)) as guard:
        layers = t.args.num_layers  # all of them MoE layers
        own = {}
        for size in (4, 2):  # the first pass records the routing, the steps replay it
            own[size] = assert_syncs(guard, train_guarded(t, guard, groups, size))
        assert per_step_syncs(own[4]) == per_step_syncs(own[2])

        rng = np.random.default_rng(0)  # the engine's routing (less the last token, which it never forwards)
        for s in flat(groups):
            s["rollout_routed_experts"] = rng.integers(0, t.args.num_experts, (len(s["tokens"]) - 1, layers,
                                                                               t.args.moe_router_topk), np.uint8)
        given = {}
        for size in (4, 2):  # replayed in every pass
            units = train_guarded(t, guard, groups, size, use_routing_replay=False, use_rollout_routing_replay=True)
            given[size] = assert_syncs(guard, units)
        assert per_step_syncs(given[4]) == per_step_syncs(given[2])


def test_critic_values_and_steps_sync_per_pass_and_step_only(tiny_qwen3):
    from tests.unit.test_critic import critic

    groups = make_rollout(seed=5)
    returns = [[float(s["reward"])] * s["response_length"] for s in flat(groups)]
    with critic(tiny_qwen3, *TWO_STEPS, "--share-group-prompts") as c, \
            HostSyncGuard(trainer_device_tensors(c)) as guard:
        runs = {}
        for size in (4, 2):
            c.args = with_values(c.args, micro_batch_size=size)
            guard.events.clear()
            values = c.compute_values(groups)
            assert_syncs(guard, {"pass": 1})
            guard.events.clear()
            c.train_critic(0, groups, values, returns)
            runs[size] = assert_syncs(guard, {"step": 2, "rollout": 1})
    assert runs[4] == runs[2]


def test_mtp_training_steps_sync_per_step_only(tmp_path_factory):
    """GLM-4.5 with its MTP layer trained (--enable-mtp-training): the MTP loss of each micro-batch (its rows,
    targets and loss weights) adds no sync; only the MTP layer's own MoE dispatch does, once per training
    micro-batch, as the decoder's MoE layers do."""
    from vime.synthetic.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("mtp"), arch="glm4_moe", seed=0, with_mtp=True)
    groups = make_rollout(seed=5)
    with local_trainer(path, *TWO_STEPS, "--mtp-num-layers", "1", "--enable-mtp-training") as t, \
            HostSyncGuard(trainer_device_tensors(t)) as guard:
        runs = {}
        for size in (4, 2):
            units = train_guarded(t, guard, groups, size)
            units["MoE layer forward"] += units["micro-batch"]  # the MTP layer's MoE: training forwards only
            runs[size] = assert_syncs(guard, units)
        assert per_step_syncs(runs[4]) == per_step_syncs(runs[2])


READING_LOSS = textwrap.dedent('''
    import torch

    def reading_loss(args, mb, log_probs, entropy, agg):
        loss = agg([-lp for lp in log_probs], mb["loss_masks"])
        torch.tensor([1.0, 2.0]).sum().item()  # a host tensor: free
        if loss.item() > 1e9:  # a device value: the host waits for the step so far, once a micro-batch
            raise ValueError("no such loss")
        return loss, {}
''')


def test_the_guard_names_a_device_read_inside_a_step_and_not_a_host_read(tiny_qwen3, tmp_path, monkeypatch):
    (tmp_path / "reading_loss_plugin.py").write_text(READING_LOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    groups = make_rollout(seed=5)
    try:
        with local_trainer(tiny_qwen3, "--custom-loss-function-path", "reading_loss_plugin.reading_loss") as t, \
                HostSyncGuard(trainer_device_tensors(t)) as guard:
            t.train(0, groups)  # one step of 16 samples: 8 micro-batches of 2
            read = "vime.trainer.micro_batch_loss:make_loss_fn.<locals>.loss_fn item"
            assert guard.counts()[read] == 8  # the device read, once a micro-batch; the host read: never
            with pytest.raises(AssertionError, match=f"not allowed in a training step: {{'{read}': 8}}"):
                assert_syncs(guard, rollout_units(t, groups))
    finally:
        sys.modules.pop("reading_loss_plugin", None)


def _guarded(op, device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> Counter:
    with HostSyncGuard([device_tensor]) as guard:
        op(device_tensor * 2, host_tensor)  # made from a device tensor: on the device
    return Counter(e.kind for e in guard.events)


DEVICE = torch.device("cpu")  # what the trainer's training_device() hands out on this machine


SYNCS = {  # what each does to a device tensor d and a host tensor h, and the one sync it makes
    "item": (lambda d, h: d.sum().item(), "item"),
    "bool": (lambda d, h: bool(d[0] > 0), "item"),
    "tolist": (lambda d, h: d.tolist(), "tolist"),
    "numpy": (lambda d, h: d.numpy(), "numpy"),
    "cpu": (lambda d, h: d.cpu(), "download"),
    "to cpu": (lambda d, h: d.to("cpu"), "download"),
    "to a host tensor's device": (lambda d, h: d.to(h.device), "download"),
    "to beside a host tensor": (lambda d, h: d.to(h), "download"),
    "copy into a host tensor": (lambda d, h: h.copy_(d), "download"),
    "cpu, then read": (lambda d, h: d.cpu().tolist(), "download"),  # the host copy reads free
    "nonzero": (lambda d, h: d.nonzero(), "nonzero"),
    "boolean mask": (lambda d, h: d[d > 0], "boolean mask index"),
    "equal": (lambda d, h: torch.equal(d, d), "equal"),
    "repeat_interleave": (lambda d, h: torch.repeat_interleave(d.long().abs()),
                          "repeat_interleave without output_size"),
    "to the device": (lambda d, h: h.to(DEVICE), "blocking upload"),
    "to beside a device tensor": (lambda d, h: h.to(d), "blocking upload"),
    "tensor from a list": (lambda d, h: torch.tensor([1, 2], device=DEVICE), "blocking upload"),
    "copy into a device tensor": (lambda d, h: d.new_zeros(2).copy_(h[:2]), "blocking upload"),
}
FREE = {  # no sync on a GPU either
    "host item": lambda d, h: h.sum().item(),
    "host tolist": lambda d, h: h.tolist(),
    "host boolean mask": lambda d, h: h[h > 0],
    "device work": lambda d, h: (d * h).sum(),
    "non-blocking upload": lambda d, h: h.to(DEVICE, non_blocking=True).add_(d).sum(),
    "the host original stays the host's": lambda d, h: h.to(DEVICE, non_blocking=True) is not h and h.tolist(),
    "filled on the device": lambda d, h: torch.full((), 1.0, device=DEVICE),
    "repeat_interleave with output_size":
        lambda d, h: torch.repeat_interleave(torch.ones_like(d, dtype=torch.long), output_size=4),
    "device to device": lambda d, h: d.to(DEVICE).sum(),
}


@pytest.mark.parametrize("name", SYNCS)
def test_the_guard_catches_each_kind_of_device_sync(name):
    op, kind = SYNCS[name]
    assert _guarded(op, torch.randn(4), torch.randn(4)) == Counter({kind: 1})


@pytest.mark.parametrize("name", FREE)
def test_the_guard_lets_host_reads_and_device_work_through(name):
    assert _guarded(FREE[name], torch.randn(4), torch.randn(4)) == Counter()
