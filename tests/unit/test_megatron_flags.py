"""Megatron-LM's flags generated from megatron-core's config dataclasses (`megatron_flags`): every field of the
configs the trainer builds is reachable by a flag or fixed by vime with a reason, flags set to non-default values
arrive in the built TransformerConfig, OptimizerConfig and DDP config of a real trainer, and Megatron-LM's
architecture flags are checked against what vime builds."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("megatron.core")

from tests.helpers.trainer_runs import BASE_ARGV  # noqa: E402
from vime.arguments import build_parser, parse_args  # noqa: E402
from vime.trainer.megatron.megatron_flags import (FIXED, HAND_DECLARED, MEGATRON_LM_NAMES,  # noqa: E402
                                                         config_classes, megatron_option_table)


def test_every_config_field_has_a_flag_or_a_reason_it_is_fixed():
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    fields = {f.name for cls in config_classes().values() for f in dataclasses.fields(cls)}
    for name in sorted(fields):
        if name in FIXED:
            assert len(FIXED[name]) > 10, name  # a reason, not a placeholder
            assert name not in dests, f"{name} is fixed by vime but also has a flag"
        else:
            assert HAND_DECLARED.get(name, name) in dests, f"megatron-core field {name} has no flag"
    # no stale entries: each names a field of this megatron-core
    assert set(FIXED) <= fields and set(HAND_DECLARED) <= fields and set(MEGATRON_LM_NAMES) <= fields
    table = {o["field"]: o for o in megatron_option_table()}
    assert len(table) > 200  # 239 in megatron-core 0.16.1
    assert table["grad_reduce_in_fp32"]["flags"][0] == "--accumulate-allreduce-grads-in-fp32"
    assert table["overlap_param_gather"]["owners"] == ["optimizer", "ddp"]  # one flag reaches both configs
    assert "recompute" in table["recompute_granularity"]["help"] and table["recompute_granularity"]["choices"] == [
        "full", "selective"]


def test_megatron_lm_names_parse_to_the_fields(tiny_qwen3, arithmetic_data):
    argv = ["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type", "math",
            "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--group-query-attention",
            "--use-rotary-position-embeddings", "--position-embedding-type", "rope",
            "--accumulate-allreduce-grads-in-fp32", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
            "--attention-softmax-in-fp32", "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1", "--optimizer", "adam"]
    args = parse_args(argv)
    assert (args.gated_linear_unit, args.add_bias_linear, args.grad_reduce_in_fp32, args.masked_softmax_fusion,
            args.gradient_accumulation_fusion, args.attention_softmax_in_fp32) == (True, False, True, False, False,
                                                                                   True)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "uniform", 1)
    assert args.init_method_std is None  # not given: vime's choice (megatron-core's default)


@pytest.mark.parametrize("flags, message", [
    (["--normalization", "LayerNorm"], "--normalization LayerNorm, but vime's models use RMSNorm"),
    (["--position-embedding-type", "learned_absolute"], "vime's models use rope"),
    (["--num-layers", "7"], "--num-layers=7 contradicts the HF config, which gives 2"),
])
def test_architecture_flags_that_contradict_what_vime_builds_fail_naming_both(tiny_qwen3, arithmetic_data, capsys,
                                                                             flags, message):
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type",
                    "math", *flags])
    assert message in capsys.readouterr().err


def test_non_default_flags_arrive_in_the_built_configs(tiny_qwen3):
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer

    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), *BASE_ARGV,
                       # TransformerConfig
                       "--init-method-std", "0.013", "--attention-softmax-in-fp32",
                       # OptimizerConfig (generated and hand-declared)
                       "--loss-scale-window", "500", "--hysteresis", "3", "--adam-beta2", "0.98", "--weight-decay",
                       "0.1",
                       # DistributedDataParallelConfig
                       "--check-for-nan-in-loss-and-grad", "--ddp-average-in-collective"])
    try:
        trainer = MegatronTrainer(args)
        config = trainer.model[0].config
        ddp = trainer.model[0].ddp_config
        optimizer = trainer.optimizer.chained_optimizers[0].config
    finally:
        destroy_parallel()
    assert config.init_method_std == 0.013 and config.attention_softmax_in_fp32 is True
    assert config.variable_seq_lengths is True and config.normalization == "RMSNorm"  # vime's own, kept
    assert (optimizer.loss_scale_window, optimizer.hysteresis, optimizer.adam_beta2, optimizer.weight_decay) == (
        500.0, 3, 0.98, 0.1)
    assert ddp.check_for_nan_in_grad is True and ddp.average_in_collective is True
    assert ddp.grad_reduce_in_fp32 is True  # vime's default, which Megatron-LM's flag also asks for


def test_unknown_flags_fail_with_the_closest_known_names(tiny_qwen3, arithmetic_data, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]),
                    "--recompute-granularty", "full", "--lr-decay", "cosine"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --recompute-granularty (did you mean --recompute-granularity" in err
    assert "--lr-decay (did you mean --lr-decay-style" in err  # no silent prefix match (allow_abbrev=False)


def test_the_slime_launch_script_parses_unchanged(tmp_path):
    """examples/slime_compat/run.sh with train.py swapped for the parser alone: every flag of the slime-style
    script is known and resolves (the script's real run, 2 rollouts, is measured by hand: see its header)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    wrapper = tmp_path / "py"
    wrapper.write_text(f"""#!/bin/sh
if [ "$1" = train.py ]; then
  shift
  exec {sys.executable} -c 'import json, sys; from vime.arguments import parse_args; a = parse_args(sys.argv[1:]); \\
print("RESOLVED " + json.dumps({{k: getattr(a, k) for k in ("sequence_parallel", "recompute_granularity",
"tensor_model_parallel_size", "gated_linear_unit", "add_bias_linear", "grad_reduce_in_fp32", "optimizer")}}))' "$@"
fi
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    env = {**os.environ, "PY": str(wrapper), "SKIP_INSTALL": "1", "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(repo / "examples" / "slime_compat" / "run.sh")], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = json.loads(proc.stdout.split("RESOLVED ", 1)[1].splitlines()[0])
    assert resolved == {"sequence_parallel": True, "recompute_granularity": "full", "tensor_model_parallel_size": 2,
                        "gated_linear_unit": True, "add_bias_linear": False, "grad_reduce_in_fp32": True,
                        "optimizer": "adam"}
    assert "--bf16 on CPU: the trainer computes in float32" in proc.stderr
    assert "--attention-backend has no effect" in proc.stderr
