"""LoRA on the Megatron trainer (one CPU process; two tensor-parallel ranks): only the adapters train and hold
optimizer state, the base stays bit-identical, the merged weights are PEFT's formula (W + alpha/r * B A) name for
name, the trainer computes with exactly those weights, and two TP ranks train like one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance, trained_weights_tolerance  # noqa: E402
from tests.helpers.hf_reference import load_hf, response_log_probs  # noqa: E402
from tests.helpers.rollouts import flat, make_rollout  # noqa: E402
from tests.helpers.trainer_runs import BASE_ARGV, launch, local_trainer as trainer  # noqa: E402
from vime.trainer.megatron.hf_checkpoint import _unwrap  # noqa: E402
from vime.trainer.megatron.lora import adapted_linears  # noqa: E402
from vime.trainer.passes import forward_log_probs  # noqa: E402
from vime.trainer.train_batch import TrainBatch  # noqa: E402

RANK, ALPHA = 4, 8.0
LORA_ARGV = ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lr", "1e-2"]
# Megatron linear -> the HF projections it fuses (the adapters' names under `<linear>.lora.policy.A/B`)
FUSED = {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"), "self_attention.linear_proj": ("o_proj",),
         "mlp.linear_fc1": ("gate_proj", "up_proj"), "mlp.linear_fc2": ("down_proj",)}
HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def test_only_adapters_train_and_the_merged_weights_are_pefts(tiny_qwen3, tmp_path):
    from safetensors.torch import load_file

    base = load_file(tiny_qwen3 / "model.safetensors")
    groups = make_rollout(seed=3)
    samples = flat(groups)
    with trainer(tiny_qwen3, *LORA_ARGV) as t:
        chunk = _unwrap(t.model[0])
        trainable = {n for n, p in chunk.named_parameters() if p.requires_grad}
        layers = len(chunk.decoder.layers)
        assert trainable == {f"decoder.layers.{i}.{linear}.lora.policy.{ab}.{proj}" for i in range(layers)
                             for linear, projs in FUSED.items() for proj in projs for ab in "AB"}
        optimized = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
        assert len(optimized) == len(trainable)  # Adam's state exists for the adapters only
        # a fresh adapter (B = 0) changes nothing: the engines' first weights are the checkpoint's
        assert all(torch.equal(w.cpu(), base[n]) for n, w in t.hf_weights())
        frozen = {n: p.detach().clone() for n, p in chunk.named_parameters() if not p.requires_grad}
        start = [torch.tensor(t.probe_log_probs(s["tokens"], s["response_length"])) for s in samples]
        grad_norms = [t.train(r, groups)["train/grad_norm"] for r in range(3)]
        assert all(torch.equal(p, frozen[n]) for n, p in chunk.named_parameters() if not p.requires_grad)
        merged = {n: w.cpu().clone() for n, w in t.hf_weights()}
        adapters = {n: p.detach().cpu().clone() for n, p in chunk.named_parameters() if p.requires_grad}
        trainer_lps = [torch.tensor(t.probe_log_probs(s["tokens"], s["response_length"])) for s in samples]
        # the training forward (base + adapters, unmerged) as well; it rounds differently from a merged weight
        batch = TrainBatch(tokens=[s["tokens"] for s in samples],
                           response_lengths=[s["response_length"] for s in samples])
        unmerged = forward_log_probs(t.args, t.model, batch, [list(range(len(samples)))])
        t.save_hf(str(tmp_path / "hf"))
    assert all(g > 0 for g in grad_norms)
    # GRPO moved the policy: rewarded responses up, the others down
    for s, a, b in zip(samples, start, trainer_lps):
        assert (b.sum() > a.sum()) == (s["reward"] > 0), s["index"]
    moved = 0
    for i in range(layers):
        for linear, projs in FUSED.items():
            for proj in projs:
                name = f"model.layers.{i}.{HF_MODULE[proj]}.{proj}.weight"
                a = adapters[f"decoder.layers.{i}.{linear}.lora.policy.A.{proj}"]
                b = adapters[f"decoder.layers.{i}.{linear}.lora.policy.B.{proj}"]
                assert a.shape == (RANK, base[name].shape[1]) and b.shape == (base[name].shape[0], RANK)
                torch.testing.assert_close(merged[name], base[name] + ALPHA / RANK * b @ a, rtol=0, atol=1e-6)
                moved += not torch.equal(merged[name], base[name])
    assert moved == layers * 7  # every targeted projection trained
    untargeted = [n for n in base if not any(f".{p}." in n for p in HF_MODULE)]
    assert untargeted and all(torch.equal(merged[n], base[n]) for n in untargeted)
    # the trainer's forward with adapters is the HF model's (on CPU) with the merged weights
    hf = load_hf(tiny_qwen3)
    hf.load_state_dict(merged, strict=False)
    for i, (s, lp) in enumerate(zip(samples, trainer_lps)):
        expected = response_log_probs(hf, s["tokens"], len(s["tokens"]) - s["response_length"])
        torch.testing.assert_close(lp, expected, rtol=0, atol=output_tolerance("logprob"))
        torch.testing.assert_close(unmerged[i][0], expected, rtol=0, atol=output_tolerance("logprob", cpu=1e-4))
    # --save-hf: the merged model, and the adapters alone in PEFT's format, which peft loads onto the HF base
    from peft import PeftModel

    assert load_hf(tmp_path / "hf").state_dict().keys() == hf.state_dict().keys()
    peft = PeftModel.from_pretrained(load_hf(tiny_qwen3), tmp_path / "hf" / "adapter").eval()
    assert peft.peft_config["default"].r == RANK and peft.peft_config["default"].lora_alpha == ALPHA
    for s, lp in zip(samples, trainer_lps):
        expected = response_log_probs(peft, s["tokens"], len(s["tokens"]) - s["response_length"])
        torch.testing.assert_close(lp, expected, rtol=0, atol=output_tolerance("logprob"))
    # --lora-load starts a new run from that adapter: its rank, alpha and targets, and the trained policy
    with trainer(tiny_qwen3, "--lora-load", str(tmp_path / "hf" / "adapter")) as t:
        assert (t.args.lora_rank, t.args.lora_alpha) == (RANK, ALPHA)
        loaded = [torch.tensor(t.probe_log_probs(s["tokens"], s["response_length"])) for s in samples]
    for lp, want in zip(loaded, trainer_lps):  # another trainer: its kernels need not round alike on a GPU
        torch.testing.assert_close(lp, want, rtol=0, atol=output_tolerance("logprob", cpu=1e-6))
    from vime.arguments import parse_args
    from vime.trainer.megatron.train_arguments import validate_lora_args

    with pytest.raises(ValueError, match="--lora-rank 8 contradicts the --lora-load adapter's 4"):
        validate_lora_args(parse_args(["--hf-checkpoint", str(tiny_qwen3), "--lora-load",
                                       str(tmp_path / "hf" / "adapter"), "--lora-rank", "8"], validate=False))


def test_lora_over_two_tensor_parallel_ranks_trains_and_resumes_like_one_process(tiny_qwen3, tmp_path):
    """Column-parallel adapters (qkv, fc1) split B, row-parallel ones (proj, fc2) split A; both ranks start from
    the one-process adapters, the summed gradients keep them there, and a checkpoint saves each rank's slices
    under their split axes (a TP2 run saves after rollout 0; a new one loads it and trains rollout 1). The
    targets are a part of each fused linear (q and v without k, up without gate), as PEFT configs often are."""
    from safetensors.torch import load_file

    targets = ["--lora-target-modules", "q_proj", "v_proj", "up_proj", "down_proj"]
    data = {str(r): make_rollout(seed=30 + r) for r in range(2)}
    with trainer(tiny_qwen3, *LORA_ARGV, *targets) as t:
        expected = [t.train(r, data[str(r)]) for r in range(2)]
        one = {n: w.cpu().clone() for n, w in t.hf_weights()}
        t.save_hf(str(tmp_path / "one_hf"))
    base = load_file(tiny_qwen3 / "model.safetensors")
    for name in one:
        targeted = any(f".{p}." in name for p in ("q_proj", "v_proj", "up_proj", "down_proj"))
        assert torch.equal(one[name], base[name]) != targeted, name

    argv = ["--hf-checkpoint", str(tiny_qwen3), *BASE_ARGV, *LORA_ARGV, *targets, "--tensor-model-parallel-size",
            "2"]
    save = str(tmp_path / "ckpt")
    first = launch({"argv": [*argv, "--save", save], "data": data, "train": [0], "save": 0}, tmp_path / "a",
                   world_size=2, timeout_s=120)
    second = launch({"argv": [*argv, "--load", save], "data": data, "train": [1], "weights": True,
                     "save_hf": str(tmp_path / "two_hf")}, tmp_path / "b", world_size=2, timeout_s=120)
    assert second[0]["loaded_state"]["rollout_id"] == 0
    for r, report in ((0, first[0]), (1, second[0])):
        for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
            assert report["metrics"][str(r)][key] == pytest.approx(expected[r][key],
                                                                   abs=output_tolerance("loss", cpu=1e-5)), (r, key)
    two = torch.load(tmp_path / "b" / "weights_rank0.pt")
    assert two.keys() == one.keys()
    assert max((two[n] - one[n]).abs().max().item() for n in one) < trained_weights_tolerance(1e-5, lr=1e-2)
    # the PEFT export gathers each adapter's tensor-parallel slices back into PEFT's whole matrices
    one_adapter, two_adapter = (load_file(tmp_path / d / "adapter" / "adapter_model.safetensors")
                                for d in ("one_hf", "two_hf"))
    assert one_adapter.keys() == two_adapter.keys() and len(one_adapter) == 2 * 4 * 2  # A, B x 4 projections x 2
    # A's entries are ~0.5: Adam's float32 rounding shows in the 5th digit; and Adam moves an entry by about lr
    # (1e-2) whatever the size of its gradient, so one whose gradient is near 0 can differ by 1% of a step (8.8e-5
    # seen once in 512); the merged weights above agree to 1e-5
    for n in one_adapter:
        torch.testing.assert_close(two_adapter[n], one_adapter[n], rtol=1e-4,
                                   atol=trained_weights_tolerance(2e-4, lr=1e-2))


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_lora_on_an_moe_model_adapts_its_dense_linears(arch, tmp_path, caplog):
    """Tiny Qwen3-MoE and GLM-4.5 (qkv biases, partial rotary, a shared expert; layer 0 dense, 1 MoE) with
    all-linear targets: attention everywhere and layer 0's MLP get adapters, the experts none (logged); a step
    trains them and leaves every expert (shared ones too) and router bit-identical."""
    from safetensors.torch import load_file

    from vime.synthetic.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "moe", seed=3, arch=arch)
    base = load_file(model / "model.safetensors")
    with caplog.at_level("WARNING"), trainer(model, *LORA_ARGV) as t:
        chunk = _unwrap(t.model[0])
        trainable = {n for n, p in chunk.named_parameters() if p.requires_grad}
        t.train(0, make_rollout(seed=4))
        merged = {n: w.cpu() for n, w in t.hf_weights()}
    assert {n.split(".lora.")[0] for n in trainable} == {
        "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj",
        "decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2",
        "decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1.self_attention.linear_proj"}
    assert "LoRA adapts no MoE experts of layer 1 (not supported yet)" in caplog.text
    experts = [n for n in base if ".mlp.experts." in n or ".shared_experts." in n or n.endswith(".mlp.gate.weight")]
    assert experts and all(torch.equal(merged[n], base[n]) for n in experts)
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(merged[q_proj], base[q_proj])


def test_lora_kl_reference_is_the_starting_adapters(tiny_qwen3):
    """With a frozen base the KL reference is the starting adapters alone (no copy of the model): zero KL at
    the first step, growing after, and the swaps in and out leave the policy and the base as they were."""
    from safetensors.torch import load_file

    base = load_file(tiny_qwen3 / "model.safetensors")
    groups = make_rollout(seed=6)
    with trainer(tiny_qwen3, *LORA_ARGV, "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type",
                 "low_var_kl") as t:
        ref_keys = {k for sd in t.ref_state for k in sd}
        metrics = [t.train(r, groups) for r in range(3)]
        adapters = {n: p.detach().clone() for n, p in _unwrap(t.model[0]).named_parameters() if p.requires_grad}
        assert all(torch.equal(w.cpu(), base[n]) for n, w in t.hf_weights() if n not in _adapted(t))
    assert ref_keys and all(".lora." in k for k in ref_keys)
    assert len(ref_keys) == len(adapters)
    assert metrics[0]["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert metrics[1]["train/kl_loss"] > 1e-5
    assert metrics[2]["train/kl_loss"] > metrics[1]["train/kl_loss"]  # the reference stays the starting policy
    for m in metrics:
        assert m["train/loss"] == pytest.approx(m["train/pg_loss"] + 0.1 * m["train/kl_loss"], abs=1e-6)


def _adapted(t) -> set[str]:
    """HF names of the weights the adapters change (merged)."""
    return {f"model.layers.{layer}.{module}.{proj}.weight"
            for layer, module, linear in adapted_linears(_unwrap(t.model[0])) for proj in linear.lora["policy"].A}


def test_lora_flags_are_checked(tmp_path):
    from vime.arguments import parse_args
    from vime.trainer.megatron.train_arguments import validate_lora_args

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    two = ["--lora-adapters", f"a={data}", f"b={data}:f1"]
    for flags, message in [(two, "--lora-adapters needs --lora-rank"),
                           (["--lora-rank", "4", "--lora-sync", "merged", *two], "needs --lora-sync adapter"),
                           (["--lora-rank", "4", "--prompt-data", str(data), *two], "drop --prompt-data"),
                           (["--lora-rank", "4", "--rollout-batch-size", "3", *two], "multiple of the 2 --lora-ad"),
                           (["--lora-rank", "4", "--lora-adapters", f"a={data}", "b=/nonexistent.jsonl"],
                            "--lora-adapters b: prompt file /nonexistent.jsonl not found"),
                           (["--lora-rank", "4", "--lora-adapters", "a"], r"'a': expected NAME=PROMPT_DATA\[:RM\]"),
                           (["--lora-rank", "4", "--lora-adapters", f"a/b={data}"], "adapter name 'a/b' must be"),
                           (["--lora-rank", "4", "--lora-adapters", f"a={data}", f"a={data}:f1"],
                            r"adapter name\(s\) a given more than once")]:
        with pytest.raises(ValueError, match=message):
            validate_lora_args(parse_args(["--hf-checkpoint", "x", "--rollout-batch-size", "4", *flags],
                                          validate=False))
    (tmp_path / "x:y").mkdir()
    colon = tmp_path / "x:y" / "p.jsonl"  # a ':' inside the data path is the path's
    colon.write_text('{"prompt": "hi"}\n')
    args = validate_lora_args(parse_args(["--hf-checkpoint", "x", "--rollout-batch-size", "4", "--lora-rank", "4",
                                          *two, "--lora-adapters", f"c.1={colon}", f"d={colon}:pkg.mod.fn"],
                                         validate=False))
    from vime.utils.lora_adapters import adapter_specs

    assert [tuple(s) for s in adapter_specs(args)] == [("a", str(data), None), ("b", str(data), "f1"),
                                                       ("c.1", str(colon), None), ("d", str(colon), "pkg.mod.fn")]

    for flags, message in [(["--lora-rank", "-1"], "--lora-rank must be >= 0"),
                           (["--lora-rank", "4", "--lora-target-modules", "qkv"], "unknown qkv"),
                           (["--lora-rank", "4", "--lora-dropout", "1.0"], r"--lora-dropout must be in \[0, 1\)"),
                           (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0"),
                           (["--lora-rank", "4", "--sequence-parallel"], "not supported yet"),
                           (["--lora-sync", "adapter"], "needs --lora-rank"),
                           (["--lora-rank", "4", "--update-weight-transport", "broadcast"], "--lora-sync merged"),
                           (["--lora-rank", "1024"], "rank <= 512"),
                           (["--lora-rank", "4", "--lora-sync", "adapter", "--rollout-external-engine-addrs",
                             "http://h:1"], "external engines get --lora-sync merged")]:
        with pytest.raises(ValueError, match=message):
            validate_lora_args(parse_args(["--hf-checkpoint", "x", *flags], validate=False))
    with pytest.raises(ValueError, match="not a PEFT adapter"):
        validate_lora_args(parse_args(["--hf-checkpoint", "x", "--lora-load", "/nonexistent"], validate=False))
    validate_lora_args(parse_args(["--hf-checkpoint", "x", "--lora-rank", "8", "--lora-target-modules", "q_proj",
                                   "v_proj"], validate=False))  # a part of the fused q/k/v, as PEFT configs often do

    for flags, sync in [([], "adapter"),  # the default where vime starts the engines
                        (["--lora-sync", "merged"], "merged"),
                        (["--rollout-external-engine-addrs", "http://h:1"], "merged"),
                        (["--lora-sync", "merged", "--update-weight-transport", "broadcast"], "merged")]:
        argv = ["--hf-checkpoint", "x", "--lora-rank", "4", *flags]
        assert validate_lora_args(parse_args(argv, validate=False)).lora_sync == sync, flags
    assert parse_args(["--hf-checkpoint", "x"], validate=False).lora_sync is None  # full fine-tuning
    # vLLM's CPU engine cannot serve adapters on an MoE model: merged weights by default where this process sees
    # no GPU; adapter sync refused on CPU engines, decided by the cluster's devices (a CPU-only head node may drive
    # GPU engines, where adapter sync works)
    from vime.arguments import validate_transport_placement

    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text('{"num_experts": 4}')
    assert validate_lora_args(parse_args(["--hf-checkpoint", str(moe), "--lora-rank", "4"],
                                         validate=False)).lora_sync == "merged"
    adapter = validate_lora_args(parse_args(["--hf-checkpoint", str(moe), "--lora-rank", "4", "--lora-sync",
                                             "adapter"], validate=False))
    assert adapter.lora_sync == "adapter"  # parsed on this CPU-only driver: its engines may be GPUs
    with pytest.raises(ValueError, match="mixture-of-experts model, and vLLM's CPU engine serves LoRA adapters on "
                                         "dense models only"):
        validate_transport_placement(adapter, gpus=False)
    validate_transport_placement(adapter, gpus=True)
    validate_transport_placement(adapter, gpus=None)


def test_adapter_sync_engine_side(tmp_path, monkeypatch):
    """What --lora-sync adapter asks of the engines: the derived LoRA flags (the user's win), the update call, a
    restarted engine's recovery call, and the load inside the server: the workers load the new version in place
    under the same id once, and later requests carry a plain request for that id (no reload at every step)."""
    import asyncio
    import json
    from types import SimpleNamespace

    from vime.engine.control.engine import lora_engine_options
    from vime.engine.protocol.names import LOAD_ADAPTER
    from vime.engine.protocol.weight_files import WEIGHT_ROOT_ENV
    from vime.engine.in_vllm.lora_serving import load_adapter
    from vime.transport.weights.base import DriverSetup
    from vime.transport.weights.lora_adapter.driver import LoraAdapterDriver
    from vime.config.train import LoraConfig, WeightSyncConfig
    from vime.rollout_manager.fleet_recovery import recovery_load_call
    from vime.driver.weight_sync import sync_kind

    args = SimpleNamespace(lora_rank=12, lora_sync="adapter", update_weight_transport="disk")
    assert lora_engine_options(args, []) == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1",
                                             "--max-cpu-loras", "1"]
    two = SimpleNamespace(lora_rank=8, lora_sync="adapter", lora_adapters=["a=x.jsonl", "b=y.jsonl:f1"])
    assert lora_engine_options(two, []) == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                                            "--max-cpu-loras", "2"]  # both resident: one batch may mix them
    assert lora_engine_options(args, ["--max-lora-rank", "64"]) == ["--enable-lora", "--max-loras", "1",
                                                                    "--max-cpu-loras", "1"]
    assert lora_engine_options(SimpleNamespace(lora_rank=12, lora_sync="merged"), []) == []
    assert sync_kind(WeightSyncConfig.of(args), LoraConfig.of(args)) == "lora_adapter"
    merged = SimpleNamespace(lora_rank=12, lora_sync="merged", update_weight_transport="delta")
    assert sync_kind(WeightSyncConfig.of(merged), LoraConfig.of(merged)) == "delta"

    root = tmp_path / "root"
    monkeypatch.setenv(WEIGHT_ROOT_ENV, str(root))
    versions = []
    for v in (1, 2):
        d = root / f"vime_lora_{v}_x" / "policy"  # an update directory holds one directory per adapter
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({"r": 12}))
        (d / "adapter_model.safetensors").write_bytes(b"")
        versions.append(str(d))
    assert recovery_load_call(args, str(root / "vime_lora_1_x")) == (LOAD_ADAPTER, {"policy": versions[0]})
    assert LoraAdapterDriver(DriverSetup.of(args)).load_calls(["http://e:1"], str(root / "vime_lora_2_x")) == {
        "http://e:1": (LOAD_ADAPTER, {"policy": versions[1]})}
    with pytest.raises(FileNotFoundError, match="wrote no adapter"):
        LoraAdapterDriver(DriverSetup.of(args)).load_calls(["http://e:1"], str(root))

    class Counter:
        n = 0

        def inc(self, k):
            self.n += k
            return self.n

    class Engine:
        added = []

        async def add_lora(self, request):
            self.added.append(request)

    models, engine = SimpleNamespace(lora_requests={}, lora_id_counter=Counter()), Engine()
    for path in versions:
        asyncio.run(load_adapter(models, engine, {"policy": path}))
    assert [(r.lora_int_id, r.lora_path, r.load_inplace) for r in engine.added] == [(1, versions[0], True),
                                                                                    (1, versions[1], True)]
    served = models.lora_requests["policy"]
    assert (served.lora_int_id, served.lora_path, served.load_inplace) == (1, versions[1], False)
    # a second adapter gets its own id; the first keeps its own
    other = root / "vime_lora_3_x" / "code"
    other.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (other / name).write_bytes((Path(versions[1]) / name).read_bytes())
    assert asyncio.run(load_adapter(models, engine, {"policy": versions[1], "code": str(other)})) == {
        "adapters": {"policy": 1, "code": 2}}
    assert {n: r.lora_int_id for n, r in models.lora_requests.items()} == {"policy": 1, "code": 2}
    added = len(engine.added)
    (root / "vime_lora_2_x" / "policy" / "adapter_model.bin").write_bytes(b"pickle")  # never loaded: vLLM unpickles
    with pytest.raises(ValueError, match="adapter_model.bin"):  # checked before any adapter is loaded
        asyncio.run(load_adapter(models, engine, {"code": str(other), "policy": versions[1]}))
    with pytest.raises(PermissionError, match="outside the weight root"):
        asyncio.run(load_adapter(models, engine, {"policy": str(tmp_path)}))
    assert len(engine.added) == added
