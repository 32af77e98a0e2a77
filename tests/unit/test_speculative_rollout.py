"""Speculative rollout with MTP layers (issue 53, items 3-6), short of the e2e:

- a weight update reaches the drafter: an engine drafting with a tiny GLM-4.5's / DeepSeek-V3's / Qwen3-Next's /
  Qwen3.5-MoE's MTP layer, given another checkpoint's tensors through vime's worker extension, holds the drafter
  (and the policy) a fresh engine of that checkpoint holds, every parameter and every linear layer's output bit for
  bit, and the drafter's MTP tensors pass the policy's loader by (tests/helpers/draft_digest.py, in a process of its
  own);
- the CPU rejection sampler's per-token temperatures are the requests' (vLLM 0.32's CPU kernel left them
  uninitialised: `cpu_sampler.patch_spec_expand`);
- the acceptance metrics from the engines' Prometheus counters, an engine restart included;
- refusals before anything starts, naming the flag: a model without MTP layers, a draft length its layers cannot
  make, a value that is not a JSON object; a CPU engine of an MLA model drafts with the float32 MLA kernel.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_a_weight_update_reaches_the_mtp_drafter(tmp_path):
    import shutil

    from vime.synthetic.tiny_model import build_tiny_model

    runs = []
    for family in ("glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5_moe"):
        old = build_tiny_model(tmp_path / family / "old", arch=family, seed=0, with_mtp=True)
        new = build_tiny_model(tmp_path / family / "new", arch=family, seed=1, with_mtp=True)
        update = tmp_path / "weights" / f"update_{family}"
        update.mkdir(parents=True)
        shutil.copy(new / "model.safetensors", update / "model-pp0.safetensors")  # the disk transport's file
        runs += [family, str(old), str(new), str(update)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "VIME_WEIGHT_ROOT": str(tmp_path / "weights")}
    proc = subprocess.run([sys.executable, str(REPO / "tests/helpers/draft_digest.py"), *runs],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for family, result in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        before, after, reference = result["before"], result["after"], result["reference"]
        draft = [k for k in reference if k.startswith("draft:") and ".layers." in k]
        # the MTP layer: norms, projections, experts, and linear layers whose weight the CPU kernel packed (float32
        # engines always; bfloat16 ones only on CPUs with AVX-512: an AMD EPYC without it kept them unpacked)
        assert len(draft) >= 10, family
        assert result["dtype"] != "float32" or any(k.endswith("(x)") for k in draft), family
        assert after == reference, family  # every parameter and linear layer of the policy and the drafter
        assert all(before[k] != reference[k] for k in draft if "norm" not in k), family
        assert result["loaded"]["in_place"] is False  # MoE models: vLLM's layer-by-layer reload


def test_cpu_spec_decoding_spreads_each_requests_sampling_values_over_its_draft_tokens():
    from vime.engine.in_vllm.cpu_sampler import expand_batch_to_tokens, patch_spec_expand

    temperature = torch.tensor([0.7, 0.0, 1.3])
    cu = torch.tensor([2, 3, 6])  # 2, 1 and 3 draft tokens
    expanded = expand_batch_to_tokens(temperature, cu, 6, replace_from=0.0, replace_to=1.0)
    assert expanded.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.3, 1.3, 1.3])
    assert expanded.dtype == torch.float32  # vLLM's CPU kernel cast it to int64 and wrote into that copy
    top_k = expand_batch_to_tokens(torch.tensor([5, 0, 7], dtype=torch.int32), cu, 6)
    assert top_k.tolist() == [5, 5, 0, 7, 7, 7] and top_k.dtype == torch.int32
    from vllm.v1.sample import rejection_sampler

    assert patch_spec_expand() and rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens


def test_draft_tensors_are_set_aside_while_the_policy_loads():
    from vime.engine.in_vllm.draft_loading import DraftSplit, is_draft_weight

    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.2.eh_proj.weight",
             "model.layers.2.mlp.experts.0.up_proj.weight", "lm_head.weight", "mtp.fc.weight"]
    assert [is_draft_weight(n, 2) for n in names] == [False, False, True, True, False, True]
    split = DraftSplit(((n, torch.zeros(1)) for n in names), num_hidden_layers=2)
    policy = [n for n, _ in itertools.islice(split, 2)]  # a loader that stops early
    split.drain()
    assert policy == names[:2]
    assert [n for n, _ in split.draft] == [names[2], names[3], names[5]]


PROMETHEUS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="policy"} 59.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="policy"} 118.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="policy"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="policy",position="0"} 20.0
vllm:num_requests_running{engine="0",model_name="policy"} 0.0
"""


def test_acceptance_metrics_come_from_the_engines_counters():
    from vime.engine.control.spec_counters import parse_counters, rollout_spec_metrics

    counters = parse_counters(PROMETHEUS)
    assert counters == {"drafts": 59.0, "draft_tokens": 118.0, "accepted": 30.0}
    before = {"a": {"drafts": 9.0, "draft_tokens": 18.0, "accepted": 10.0}, "b": counters}
    after = {"a": counters,  # 50 drafts of 2 tokens, 20 accepted
             "b": {"drafts": 10.0, "draft_tokens": 20.0, "accepted": 5.0}}  # restarted: its counts since
    metrics = rollout_spec_metrics(before, after)
    assert metrics["rollout/spec_draft_tokens"] == 120.0
    assert metrics["rollout/spec_acceptance_rate"] == pytest.approx(25 / 120)
    assert metrics["rollout/spec_mean_accepted_length"] == pytest.approx(1 + 25 / 60)
    assert rollout_spec_metrics(after, after) == {}  # nothing drafted: nothing to report
    assert parse_counters("vllm:num_requests_running 1.0\n") == {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}


@pytest.fixture(scope="module")
def mtp_glm(tmp_path_factory) -> Path:
    from vime.synthetic.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("spec_glm"), arch="glm4_moe", seed=0, with_mtp=True)


@pytest.mark.parametrize("config, match", [
    ('{"method": "mtp", "num_speculative_tokens": 3}', None),  # one layer, repeated: runs
    ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1, got 0"),
    ('[1, 2]', "must be a JSON object"),
])
def test_speculative_configs_are_checked_against_the_checkpoint(config, match, mtp_glm, tiny_qwen3, tmp_path):
    from vime.arguments import check_model_args, parse_args

    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    base = ["--prompt-data", str(tmp_path / "p.jsonl"), "--rm-type", "math", "--mtp-num-layers", "1",
            "--vllm-speculative-config", config]
    args = parse_args(["--hf-checkpoint", str(mtp_glm), *base], check_model=False)
    if match is None:
        check_model_args(args)
    else:
        with pytest.raises(ValueError, match=match):
            check_model_args(args)


def test_a_model_without_mtp_layers_and_a_draft_length_they_cannot_make_are_refused(tiny_qwen3, tmp_path):
    from vime.arguments import check_model_args, parse_args
    from vime.engine.control.speculative import check_speculative

    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    spec = '{"method": "mtp", "num_speculative_tokens": 1}'
    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(tmp_path / "p.jsonl"),
                       "--rm-type", "math", "--vllm-speculative-config", spec], check_model=False)
    with pytest.raises(ValueError, match=r"--vllm-speculative-config .*: qwen3 declares no MTP layers"):
        check_model_args(args)
    two_layers = {"model_type": "deepseek_v3", "num_nextn_predict_layers": 2}
    args.vllm_speculative_config = '{"method": "deepseek_mtp", "num_speculative_tokens": 3}'
    with pytest.raises(ValueError, match="num_speculative_tokens 3 with 2 MTP layers: .* at most 2 or a multiple"):
        check_speculative(args, two_layers)
    args.vllm_speculative_config = '{"method": "mtp", "num_speculative_tokens": 4}'
    check_speculative(args, two_layers)
    check_speculative(args, {"model_type": "qwen3_next"})  # one MTP layer left unsaid, as vLLM reads it
    args.vllm_speculative_config = '{"method": "ngram", "num_speculative_tokens": 3}'  # not MTP: vLLM's to judge
    check_speculative(args, {"model_type": "qwen3"})
    args.vllm_speculative_config = '{"method": "mtp"'
    with pytest.raises(ValueError, match="--vllm-speculative-config .* is not JSON"):
        check_speculative(args, two_layers)
    with pytest.raises(SystemExit):  # what the flags' parsing says first (vLLM's parser reads the JSON)
        parse_args(["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(tmp_path / "p.jsonl"),
                    "--rm-type", "math", "--vllm-speculative-config", '{"method": "mtp"'], check_model=False)


def test_a_cpu_engine_of_an_mla_model_drafts_with_the_float32_mla_kernel(tmp_path):
    from vime.arguments import parse_args
    from vime.engine.control.engine import engine_command
    from vime.synthetic.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "ds", arch="deepseek_v3", seed=0, with_mtp=True)
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    args = parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "p.jsonl"), "--rm-type", "math",
                       "--vllm-speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
                      check_model=False)
    cmd = engine_command(args, "127.0.0.1", 8000, 0)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "CPU_MLA"}
    assert cmd[cmd.index("--attention-backend") + 1] == "CPU_MLA"
