"""What a slime launch script and its plugins need beyond the flags vime already had, unit by unit: SGLang engine
flags mapped to vLLM's or refused by name; --ref-load / --ref-update-interval / --keep-old-actor / --wandb-key;
slime's train-data conversion folded back into the samples; the postprocess hook's rollout_data; a slime data source
class behind vime's interface; the old actor's weights by version."""

from __future__ import annotations

import logging

import pytest
import torch

from vime.arguments import build_parser, parse_args
from vime.data.sample import Sample
from vime.data.slime_data_source import SlimeDataSource
from vime.engine.control.sglang_flags import SGLANG_FLAGS, SGLangFlagError, translate_sglang_flags
from vime.rollout.train_data import apply_train_data
from vime.trainer.hooks import apply_rollout_data, rollout_data_view
from vime.trainer.old_actor import OldActor
from vime.trainer.reference import refresh_due
from vime.trainer.train_batch import TrainBatch
from vime.utils.resolved_config import plain_values


def test_sglang_flags_become_vllms_with_a_notice():
    argv = ["--lr", "1e-6", "--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2", "4",
            "--sglang-attention-backend=fa3", "--sglang-disable-radix-cache", "--rollout-num-gpus-per-engine", "2"]
    out, notices = translate_sglang_flags(argv)
    assert out == ["--lr", "1e-6", "--vllm-gpu-memory-utilization", "0.7", "--vllm-cudagraph-capture-sizes", "1",
                   "2", "4", "--vllm-attention-backend", "FLASH_ATTN", "--no-vllm-enable-prefix-caching",
                   "--rollout-num-gpus-per-engine", "2"]
    assert len(notices) == 4 and notices[0].startswith(
        "--sglang-mem-fraction-static 0.7 -> --vllm-gpu-memory-utilization 0.7 (")


def test_every_mapped_sglang_flag_lands_on_a_flag_train_py_has():
    known = {o for a in build_parser()._actions for o in a.option_strings}
    targets = {spec.to for spec in SGLANG_FLAGS.values() if spec.to}
    assert targets <= known, targets - known


def test_sglang_flags_without_an_equivalent_are_refused_naming_what_to_use():
    with pytest.raises(SGLangFlagError) as e:
        translate_sglang_flags(["--sglang-server-concurrency", "64", "--sglang-enable-dp-attention",
                                "--sglang-speculative-num-steps", "3", "--sglang-made-up", "x", "y",
                                "--sglang-attention-backend", "aiter"])
    text = str(e.value)
    assert "--sglang-server-concurrency: use --rollout-concurrency" in text
    assert "--sglang-enable-dp-attention: vime starts one engine per --rollout-num-gpus-per-engine" in text
    assert "--sglang-speculative-num-steps: use --vllm-speculative-config" in text
    assert "--sglang-made-up: vime maps only" in text
    assert "--sglang-attention-backend aiter: no vLLM equivalent" in text


def test_a_refused_sglang_flag_stops_parsing_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", "x", "--sglang-dp-size", "2"], validate=False)
    assert "--sglang-dp-size" in capsys.readouterr().err


def test_mapped_flags_parse_as_vllms(caplog):
    caplog.set_level(logging.WARNING, logger="vime.arguments")
    args = parse_args(["--sglang-mem-fraction-static", "0.7", "--sglang-max-running-requests", "64"], validate=False)
    # the engine's command line gets vLLM's own spelling
    assert args.vllm_raw_cli["vllm_gpu_memory_utilization"] == ["--gpu-memory-utilization", "0.7"]
    assert args.vllm_raw_cli["vllm_max_num_seqs"] == ["--max-num-seqs", "64"]
    assert "-> --vllm-max-num-seqs 64" in caplog.text


def _refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv, check_model=False)
    return capsys.readouterr().err


def test_ref_load_must_be_a_checkpoint_and_not_under_lora(tmp_path, tiny_qwen3, arithmetic_data, capsys):
    base = ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type", "math",
            "--use-kl-loss"]
    assert "--ref-load " + str(tmp_path / "missing") + " does not exist" in _refusal(
        capsys, [*base, "--ref-load", str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    assert "is neither a torch_dist checkpoint" in _refusal(capsys, [*base, "--ref-load", str(tmp_path / "empty")])
    assert "--ref-load with --lora-rank" in _refusal(capsys, [*base, "--ref-load", str(tiny_qwen3), "--lora-rank",
                                                              "4"])
    assert "--ref-update-interval must be >= 1" in _refusal(capsys, [*base, "--ref-update-interval", "0"])
    assert parse_args([*base, "--ref-load", str(tiny_qwen3)], check_model=False).ref_load == str(tiny_qwen3)


def test_wandb_key_is_a_secret_never_written(tiny_qwen3, arithmetic_data):
    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type",
                       "math", "--use-wandb", "--wandb-mode", "offline", "--wandb-key", "k" * 40], check_model=False)
    assert args.wandb_key == "k" * 40 and "wandb_key" not in plain_values(args)


def test_ref_update_interval_counts_rollouts_from_one():
    assert [r for r in range(7) if refresh_due(r, 3)] == [2, 5]
    assert not any(refresh_due(r, None) for r in range(5))


def _samples(n=2):
    return [Sample(index=i, tokens=[1, 2, 3, 4], response_length=2, reward=1.0, loss_mask=[1, 1],
                   rollout_log_probs=[-0.5, -0.25], status=Sample.Status.COMPLETED) for i in range(n)]


def test_converted_train_data_is_what_the_trainer_gets():
    samples = _samples()
    apply_train_data(samples, {"tokens": [[1, 2, 3, 4, 5], [1, 2, 3, 4]], "response_lengths": [3, 2],
                               "loss_masks": [[1, 0, 1], [0, 0]], "rewards": [0.5, -0.5], "truncated": [1, 0],
                               "rollout_log_probs": [[-1.0, -2.0, -3.0], [-0.1, -0.2]],
                               "raw_reward": [1.0, 0.0], "sample_indices": [0, 1]}, "my.convert")
    first, second = samples
    assert first.tokens == [1, 2, 3, 4, 5] and first.response_length == 3 and first.loss_mask == [1, 0, 1]
    assert first.reward == 0.5 and first.status == Sample.Status.TRUNCATED and first.rollout_log_probs[-1] == -3.0
    assert second.reward == -0.5 and second.loss_mask == [0, 0] and second.status == Sample.Status.COMPLETED
    assert first.metadata["train_data"] == {"raw_reward": 1.0, "sample_indices": 0}
    with pytest.raises(ValueError, match="keys vime does not train on: values"):
        apply_train_data(_samples(), {"values": [1, 2]}, "my.convert")
    with pytest.raises(ValueError, match="one entry per sample"):
        apply_train_data(_samples(), {"rewards": [1.0]}, "my.convert")
    with pytest.raises(ValueError, match="3 loss-mask entries for a response of 2"):
        apply_train_data(_samples(), {"loss_masks": [[1, 1, 1], [1, 1]]}, "my.convert")


def test_postprocess_changes_reach_the_batch_and_bad_shapes_are_refused():
    batch = TrainBatch(tokens=[[1, 2, 3], [1, 2, 3, 4]], response_lengths=[1, 2],
                       loss_masks=[torch.ones(1), torch.ones(2)], rewards=torch.tensor([1.0, 0.0]),
                       advantages=[torch.ones(1), -torch.ones(2)])
    data = rollout_data_view(batch)
    assert data["rewards"] == [1.0, 0.0] and data["loss_masks"] is batch.loss_masks
    data["loss_masks"][1][0] = 0  # in place, as slime's hooks do
    data["advantages"] = [[2.0], [3.0, 4.0]]  # or replaced
    apply_rollout_data(batch, data, "my.postprocess")
    assert batch.loss_masks[1].tolist() == [0.0, 1.0] and batch.advantages[1].tolist() == [3.0, 4.0]
    data["advantages"] = [[2.0], [3.0]]
    with pytest.raises(ValueError, match=r"rollout_data\['advantages'\]\[1\] has 1 values for a response of 2"):
        apply_rollout_data(batch, data, "my.postprocess")


class _SlimeStyleSource:
    def __init__(self, args):
        self.args, self.saved, self.loaded = args, [], []

    def get_samples(self, num_samples):
        return [[Sample(index=i, prompt="p")] for i in range(num_samples)]

    def add_samples(self, samples):
        pass

    def save(self, rollout_id):
        self.saved.append(rollout_id)

    def load(self, rollout_id=None):
        self.loaded.append(rollout_id)

    def __len__(self):
        return 5


def test_a_slime_data_source_saves_after_each_rollout_and_loads_on_resume():
    source = SlimeDataSource(_SlimeStyleSource(None), "my.Source", saves=True)
    assert len(source) == 5 and len(source.get_samples(3)) == 3
    source.after_rollout(0)
    source.after_rollout(1)
    state = source.state_dict()
    assert source.source.saved == [0, 1] and state == {"slime_data_source_saved_at": 1}
    resumed = SlimeDataSource(_SlimeStyleSource(None), "my.Source", saves=True)
    resumed.load_state_dict(state)
    assert resumed.source.loaded == [1]
    quiet = SlimeDataSource(_SlimeStyleSource(None), "my.Source", saves=False)  # no --save: nothing to write to
    quiet.after_rollout(0)
    assert quiet.source.saved == []
    with pytest.raises(TypeError, match="has no get_samples"):
        SlimeDataSource(object(), "my.Broken", saves=False)


class _Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))


class _Chunk:  # what `snapshot` reads: chunk.module.state_dict()
    def __init__(self):
        self.module = _Module()


def test_old_actor_keeps_the_weights_of_recent_versions():
    model = [_Chunk()]
    old = OldActor(window=2)
    for version in range(5):
        with torch.no_grad():
            model[0].module.w.fill_(version)
        old.keep(model, version)
    assert sorted(old.states) == [2, 3, 4]
    states = old.states_for([3, 4, None, 3], current=4)
    assert list(states) == [3] and states[3][0]["w"].tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match=r"version\(s\) \[1\]"):
        old.states_for([1, 4], current=4)


def test_routed_experts_split_over_expert_tensor_parallel_when_it_differs(tmp_path):
    """slime's MoE scripts: --tensor-model-parallel-size 4 beside --expert-tensor-parallel-size 1. The routed
    experts are whole on each rank (split over ETP), attention and the router's weights still split over TP."""
    from transformers import AutoConfig

    from vime.trainer.megatron.hf_checkpoint import _SafetensorsDir
    from vime.trainer.megatron.hf_conversion import Arch, hf_to_chunk, is_routed_expert
    from vime.synthetic.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=0, config={"mlp_only_layers": []})
    arch = Arch.from_hf(AutoConfig.from_pretrained(path))
    hf = _SafetensorsDir(path)
    whole = hf_to_chunk(hf, arch, 0, 1, 0, arch.num_layers, True, True)
    folded = hf_to_chunk(hf, arch, 1, 2, 0, arch.num_layers, True, True, ep_rank=0, ep_size=2, etp=(0, 1))
    tp_only = hf_to_chunk(hf, arch, 1, 2, 0, arch.num_layers, True, True, ep_rank=0, ep_size=2)
    experts = [n for n in folded if is_routed_expert(n)]
    assert experts and all(torch.equal(folded[n], whole[n]) for n in experts)  # EP rank 0 holds experts 0..E/2-1
    assert all(tp_only[n].shape[0] * 2 == whole[n].shape[0] or tp_only[n].shape[-1] * 2 == whole[n].shape[-1]
               for n in experts)
    qkv = next(n for n in folded if n.endswith("linear_qkv.weight"))
    assert folded[qkv].shape[0] * 2 == whole[qkv].shape[0]  # attention: still TP rank 1 of 2
