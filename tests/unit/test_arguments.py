"""The three flag groups, the YAML config and validation errors (no process is started)."""

from __future__ import annotations

import pytest

from vime.backends.vllm_utils.arguments import vllm_cli_tokens
from vime.arguments import build_parser, parse_args


@pytest.fixture()
def base(tiny_qwen3, arithmetic_data):
    return ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type", "math"]


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err


def test_three_groups_share_one_parser():
    options = {o for a in build_parser()._actions for o in a.option_strings}
    assert {"--tensor-model-parallel-size", "--micro-batch-size", "--lr"} <= options  # Megatron's names
    assert {"--vllm-max-model-len", "--vllm-enforce-eager", "--no-vllm-enforce-eager", "--vllm-dtype"} <= options
    assert {"--router-policy", "--vllm-router-ip", "--vllm-router-port"} <= options
    assert {"--rollout-batch-size", "--n-samples-per-prompt", "--rm-type", "--custom-rm-path"} <= options
    assert "--vllm-model" not in options and "--vllm-port" not in options  # vime sets those itself
    for action in build_parser()._actions:
        if action.option_strings and not action.option_strings[0].startswith(("--vllm-", "--no-vllm-", "-h")):
            assert action.help, f"{action.option_strings} has no help text"


def test_vllm_options_are_forwarded_verbatim(base):
    args = parse_args(base + ["--vllm-max-model-len", "512", "--no-vllm-enable-prefix-caching",
                              "--vllm-enforce-eager", "--vllm-dtype", "float32"])
    assert vllm_cli_tokens(args) == ["--max-model-len", "512", "--no-enable-prefix-caching", "--enforce-eager",
                                     "--dtype", "float32"]
    assert args.vllm_engine_args.max_model_len == 512  # parsed by vLLM's own parser
    assert args.vllm_engine_args.enable_prefix_caching is False
    assert args.router_policy == "round_robin"


def test_bad_vllm_option_is_rejected_before_start(base, capsys):
    err = _error(capsys, base + ["--vllm-dtype", "float99"])
    assert "float99" in err


def test_yaml_config_supplies_flags_and_cli_wins(base, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout_batch_size: 16\nn-samples-per-prompt: 4\napply_chat_template: true\n"
                   "vllm-max-model-len: 256\nrollout_stop: [\"\\n\\n\", END]\n")
    args = parse_args(base + ["--config", str(cfg), "--rollout-batch-size", "2"])
    assert args.rollout_batch_size == 2 and args.n_samples_per_prompt == 4 and args.apply_chat_template
    assert args.vllm_engine_args.max_model_len == 256 and args.rollout_stop == ["\n\n", "END"]


def test_yaml_config_unknown_key(base, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout_bach_size: 16\n")
    assert "unknown flag 'rollout_bach_size'" in _error(capsys, base + ["--config", str(cfg)])


@pytest.mark.parametrize("extra, message", [
    (["--debug-rollout-only", "--debug-train-only"], "exclude each other"),
    (["--rollout-batch-size", "8", "--over-sampling-batch-size", "4"], "--over-sampling-batch-size (4) must be >="),
    (["--rollout-temperature", "0"], "--rollout-temperature must be > 0"),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "must be a multiple"),
    (["--save-debug-rollout-data", "/tmp/x.jsonl"], "must contain '{rollout_id}'"),
    (["--debug-train-only"], "needs --load-debug-rollout-data"),
    (["--rm-type", "remote_rm"], "--rm-url"),
    (["--custom-rm-path", "no_such_module.reward"], "--custom-rm-path: cannot import module"),
    (["--rollout-function-path", "vime.utils.misc.nope"], "has no attribute 'nope'"),
    (["--rollout-external-engine-addrs", "localhost"], "is not host:port"),
    (["--eval-prompt-data", "only_a_name"], "pairs NAME PATH"),
    (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt must be >= 1"),
    (["--offload-train"], "--offload-train only makes sense with --colocate"),
    (["--use-fault-tolerance", "--rollout-external-engine-addrs", "h:1"], "cannot restart"),
    (["--rollout-health-check-interval", "0"], "--rollout-health-check-interval must be > 0"),
])
def test_validation_errors_name_the_flag(base, capsys, extra, message):
    assert message in _error(capsys, base + extra)


FUNCTION_PATH_FLAGS = sorted(
    a.option_strings[0] for a in build_parser()._actions
    if a.dest.endswith(("_path", "_paths")) and not a.dest.startswith(("vllm_", "router_")))


def test_every_function_path_flag_is_found():
    assert {"--custom-loss-function-path", "--custom-advantage-function-path", "--custom-rm-path",
            "--agent-tool-paths", "--rollout-function-path"} <= set(FUNCTION_PATH_FLAGS)


@pytest.mark.parametrize("flag", FUNCTION_PATH_FLAGS)
def test_a_bad_function_path_fails_at_parse_naming_its_flag(base, capsys, flag):
    """Before anything starts, not inside a training rank or an engine's rollout."""
    err = _error(capsys, base + [flag, "no_such_module.fn"])
    assert f"{flag}: cannot import module 'no_such_module'" in err, err


def test_missing_inputs(tiny_qwen3, capsys, tmp_path):
    assert "--hf-checkpoint DIR is required" in _error(capsys, ["--rm-type", "math"])
    assert "no config.json" in _error(capsys, ["--hf-checkpoint", str(tmp_path), "--rm-type", "math"])
    assert "--prompt-data FILE is required" in _error(capsys, ["--hf-checkpoint", str(tiny_qwen3), "--rm-type", "f1"])
    err = _error(capsys, ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(tmp_path / "nope.jsonl"),
                          "--rm-type", "f1"])
    assert "nope.jsonl: file not found" in err


def test_reward_is_required(tiny_qwen3, arithmetic_data, capsys):
    err = _error(capsys, ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0])])
    assert "--rm-type" in err and "--custom-rm-path" in err


def test_derived_defaults(base):
    args = parse_args(base + ["--seed", "7", "--rollout-temperature", "0.7"])
    assert args.rollout_seed == 7 and args.over_sampling_batch_size == args.rollout_batch_size
    assert args.eval_temperature == 0.7 and args.eval_max_response_len == args.rollout_max_response_len
