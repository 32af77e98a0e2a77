"""<output-dir>/config.yaml: the resolved flags of a run, which --config reads back to the same flags."""

from __future__ import annotations

import os

import yaml

from vime.arguments import build_parser, parse_args
from vime.utils.resolved_config import write_resolved_config


def test_resolved_config_round_trips(tiny_qwen3, arithmetic_data, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t" * 64)
    os.chmod(token_file, 0o600)
    argv = ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type", "math",
            "--output-dir", str(tmp_path / "out"), "--seed", "7", "--num-rollout", "3",  # run
            "--control-token-file", str(token_file),
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--rollout-stop", "\n\n", "END",  # rollout
            "--eval-prompt-data", "arith", str(arithmetic_data[1]),
            "--lr", "2e-5", "--micro-batch-size", "2", "--num-layers", "2", "--hidden-size", "128",  # Megatron
            "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.01",  # algorithm
            "--vllm-max-model-len", "512", "--no-vllm-enable-prefix-caching", "--vllm-enforce-eager",  # vLLM
            "--router-policy", "random",  # router
            "--use-wandb", "--wandb-mode", "offline"]  # wandb
    args = parse_args(argv)
    path = write_resolved_config(args, tmp_path / "out" / "config.yaml", build_parser())

    written = yaml.safe_load(path.read_text())
    assert written["global-batch-size"] == args.global_batch_size == 32  # derived by validation, written too
    assert written["control-token-file"] == str(token_file) and "t" * 64 not in path.read_text()
    assert "router-api-key" not in written and "vllm-hf-token" not in written  # secrets are never written
    assert written["vllm-enable-prefix-caching"] is False and "vllm_raw_cli" not in written

    again = parse_args(["--config", str(path)])
    assert again.config == str(path)  # the one difference: where the flags came from
    assert {**vars(again), "config": None} == vars(args)


def test_flags_that_only_negate_round_trip(tmp_path, tiny_qwen3, arithmetic_data):
    """Megatron-LM's --no-masked-softmax-fusion and --disable-bias-linear store False into a field no positive flag
    sets: config.yaml writes the negating flag itself."""
    from vime.arguments import build_parser, parse_args
    from vime.utils.resolved_config import write_resolved_config

    argv = ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type", "math",
            "--no-masked-softmax-fusion", "--disable-bias-linear"]
    args = parse_args(argv)
    path = write_resolved_config(args, tmp_path / "config.yaml", build_parser())
    again = parse_args(["--config", str(path)])
    assert (again.masked_softmax_fusion, again.add_bias_linear) == (False, False)
    assert again.apply_rope_fusion is None  # not given: not written
