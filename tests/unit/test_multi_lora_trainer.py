"""Multi-LoRA on the Megatron trainer (one CPU process): two named adapters on one frozen base. Each sample is
computed through its own adapter, in packed and padded micro-batches that mix both, exactly as that adapter alone
computes it (and, within 1e-5, as its merged weights do); a rollout of one adapter's samples trains that adapter
only; each adapter's advantages come from its own samples; the exports and weight updates hold one PEFT adapter per
name; a checkpoint holds both adapters and resumes to the same next step."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.devices import output_tolerance  # noqa: E402
from tests.helpers.rollouts import flat, make_rollout  # noqa: E402
from vime.algorithms import masked_mean_std  # noqa: E402
from vime.trainer.megatron.checkpoint_files import publish  # noqa: E402
from tests.helpers.trainer_runs import local_trainer as trainer  # noqa: E402
from vime.data.sample import ADAPTER_KEY  # noqa: E402
from vime.trainer.batch_advantages import compute_advantages  # noqa: E402
from vime.trainer.megatron.hf_checkpoint import _unwrap  # noqa: E402
from vime.trainer.megatron.lora import adapters_merged  # noqa: E402
from vime.trainer.passes import forward_log_probs  # noqa: E402
from vime.trainer.train_batch import TrainBatch  # noqa: E402
from vime.utils.misc import with_values  # noqa: E402

RANK = 4


def _tagged(groups, names):
    """The groups with group k's samples tagged with adapter names[k % len(names)]."""
    for k, group in enumerate(groups):
        for s in group:
            s["metadata"] = {**s.get("metadata", {}), ADAPTER_KEY: names[k % len(names)]}
    return groups


def test_two_adapters_route_train_and_export_apart(tiny_qwen3, tmp_path):
    from safetensors.torch import load_file

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    # no weight decay: it would shrink an adapter's A whatever its gradient (every parameter's, each step)
    argv = ["--lora-rank", str(RANK), "--lr", "1e-2", "--weight-decay", "0",
            "--lora-adapters", f"math={prompts}", f"code={prompts}:f1"]
    save = str(tmp_path / "ckpt")
    with trainer(tiny_qwen3, *argv, "--save", save) as t:
        chunk = _unwrap(t.model[0])

        def adapter(name):  # on CPU, to compare with the exported files
            return {n: p.detach().cpu().clone() for n, p in chunk.named_parameters() if f".lora.{name}." in n}

        math0, code0 = adapter("math"), adapter("code")
        assert {p.requires_grad for n, p in chunk.named_parameters() if ".lora." in n} == {True}
        assert len(math0) == len(code0) > 0 and all(not p.requires_grad for n, p in chunk.named_parameters()
                                                    if ".lora." not in n)
        # a rollout of one adapter's samples trains that adapter alone; the other is bit-identical
        t.train(0, _tagged(make_rollout(seed=3), ["math"]))
        math1 = adapter("math")
        assert any(not torch.equal(math1[n], math0[n]) for n in math0)
        assert all(torch.equal(p, code0[n]) for n, p in adapter("code").items())
        # a mixed rollout trains both
        t.train(1, _tagged(make_rollout(seed=4), ["math", "code"]))
        assert any(not torch.equal(p, code0[n]) for n, p in adapter("code").items())
        assert any(not torch.equal(p, math1[n]) for n, p in adapter("math").items())

        # one mixed micro-batch computes each sample through its own adapter, packed and padded
        samples = flat(_tagged(make_rollout(seed=5), ["math", "code"]))
        names = [s["metadata"][ADAPTER_KEY] for s in samples]
        batch = TrainBatch(tokens=[s["tokens"] for s in samples],
                           response_lengths=[s["response_length"] for s in samples],
                           adapters=[["math", "code"].index(n) for n in names])
        alone = {name: [torch.tensor(t.probe_log_probs(s["tokens"], s["response_length"], adapter=name))
                        for s in samples] for name in ("math", "code")}
        for name in ("math", "code"):  # the adapter's own path is its merged weights' (what merged sync sends)
            with adapters_merged(t.model, name):
                merged = [torch.tensor(t.probe_log_probs(s["tokens"], s["response_length"], adapter=name))
                          for s in samples]
            for a, b in zip(alone[name], merged):
                torch.testing.assert_close(a, b, rtol=0, atol=output_tolerance("logprob"))
        # the adapters differ, so a token sent through the wrong one would show
        apart = max((a - b).abs().max().item() for a, b in zip(alone["math"], alone["code"]))
        assert apart > max(1e-3, output_tolerance("logprob")), apart
        for layout in ("thd", "bshd"):
            mixed = forward_log_probs(with_values(t.args, qkv_format=layout), t.model, batch,
                                      [list(range(len(samples)))])
            for i, name in enumerate(names):
                torch.testing.assert_close(mixed[i][0], alone[name][i], rtol=0, atol=output_tolerance("logprob"),
                                           msg=f"{layout} {i}")

        # each adapter's advantages are whitened over its own samples (REINFORCE++-baseline whitens the batch)
        mixed = TrainBatch.from_samples(_tagged(make_rollout(seed=6), ["math", "code"]), t.args)
        compute_advantages(with_values(t.args, advantage_estimator="reinforce_plus_plus_baseline"), mixed)
        for k in (0, 1):
            rows = [i for i, a in enumerate(mixed.adapters) if a == k]
            mean, std = masked_mean_std([mixed.advantages[i] for i in rows], [mixed.loss_masks[i] for i in rows])
            assert mean == pytest.approx(0.0, abs=1e-6) and std == pytest.approx(1.0, abs=1e-3), (k, mean, std)

        t.save_hf(str(tmp_path / "hf"))
        # a weight update: one PEFT adapter per name
        from vime.transport.weights.lora_adapter.rank import LoraAdapterSender

        update = tmp_path / "update"
        update.mkdir()
        t.send_weights(LoraAdapterSender(), str(update))
        final = {name: adapter(name) for name in ("math", "code")}
        t.save(1, {})
        publish(save, 1)
        next_step = t.train(2, _tagged(make_rollout(seed=7), ["math", "code"]))
    # a checkpoint holds both adapters (and their Adam state): a resumed trainer takes the same next step
    with trainer(tiny_qwen3, *argv, "--load", save) as resumed:
        chunk = _unwrap(resumed.model[0])
        assert resumed.get_loaded_state()["rollout_id"] == 1
        for name in ("math", "code"):
            assert all(torch.equal(p, final[name][n]) for n, p in chunk.named_parameters() if f".lora.{name}." in n)
        again = resumed.train(2, _tagged(make_rollout(seed=7), ["math", "code"]))
    # another trainer: its kernels need not round alike on a GPU
    assert again["train/grad_norm"] == pytest.approx(next_step["train/grad_norm"], rel=1e-5,
                                                     abs=output_tolerance("loss", cpu=0.0))
    assert again["train/loss"] == pytest.approx(next_step["train/loss"], abs=output_tolerance("loss"))
    for root in (tmp_path / "hf" / "adapter", update):
        assert sorted(p.name for p in root.iterdir()) == ["code", "math"]
        for name in ("math", "code"):
            assert json.loads((root / name / "adapter_config.json").read_text())["r"] == RANK
            saved = load_file(root / name / "adapter_model.safetensors")
            assert len(saved) == len(final[name])
            q_a = saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
            assert torch.equal(q_a, final[name]["decoder.layers.0.self_attention.linear_qkv.lora." + name
                                                + ".A.q_proj"])
    # the HF checkpoint of a multi-LoRA run is the base: each adapter lives beside it
    base = load_file(tiny_qwen3 / "model.safetensors")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(exported[n], base[n]) for n in base)


def test_a_sample_without_its_adapter_is_refused():
    from argparse import Namespace

    from vime.data.sample import Sample

    args = Namespace(lora_adapters=["math=a.jsonl", "code=b.jsonl"], reward_key=None)
    groups = _tagged(make_rollout(seed=1, num_prompts=2), ["math", "code"])
    assert TrainBatch.from_samples(groups, args).adapters == [0] * 4 + [1] * 4
    groups[1][2]["metadata"].pop(ADAPTER_KEY)
    with pytest.raises(ValueError, match=r"sample 6: metadata\['lora_adapter'\] is None, not one of the run's "
                                         r"--lora-adapters \(math, code\)"):
        TrainBatch.from_samples(groups, args)
    assert Sample.from_dict(groups[0][0]).metadata[ADAPTER_KEY] == "math"
