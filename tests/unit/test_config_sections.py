"""The run's typed config (vime/config): its sections and the parser agree flag by flag, every default has its
field's type, a parsed run builds a frozen config whose slime-style view is the namespace it came from, and a
wrong value or an unowned entry is refused by name."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest

from vime.arguments import _dests, build_parser, parse_args, run_config
from vime.config import RunConfig
from vime.config.rollout import RewardConfig, RolloutConfig
from vime.config.section import Section, add_flags, flag
from vime.config.section import check_types, section_defaults
from vime.engine.control.arguments import add_router_args, add_vllm_engine_args
from vime.trainer.megatron.megatron_flags import add_generated_megatron_args


def _owners() -> dict[str, list[str]]:
    owners: dict[str, list[str]] = {}
    for name, section in RunConfig.sections().items():
        for field in section.flag_names():
            owners.setdefault(field, []).append(name)
    return owners


def test_every_flag_has_one_owner_a_typed_section_or_a_pass_through_group():
    parser = build_parser()
    owners = _owners()
    passed = _dests(add_generated_megatron_args) | _dests(add_vllm_engine_args) | _dests(add_router_args)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert not {f: o for f, o in owners.items() if len(o) > 1}
    assert not set(owners) - dests  # a section field with no flag must be marked derived()
    assert not dests - set(owners) - passed
    assert len(owners) > 250 and len(dests) > 800  # the typed sections are vime's own flags, Megatron-LM's hand ones


def test_the_parser_takes_its_defaults_from_the_sections_and_each_has_its_type():
    parser = build_parser()
    for name, section in RunConfig.sections().items():
        defaults = section_defaults(section)
        for field in section.flag_names():
            assert parser.get_default(field) == defaults[field], (name, field)
        check_types(section(**defaults))  # raises naming a default of the wrong type


def test_a_parsed_run_builds_a_frozen_config_whose_namespace_is_the_parsed_one(tiny_qwen3, arithmetic_data, tmp_path):
    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type",
                       "math", "--output-dir", str(tmp_path), "--rollout-batch-size", "4", "--rollout-stop", "END",
                       "--advantage-estimator", "ppo", "--vllm-max-model-len", "256", "--router-policy", "random",
                       "--lr", "3e-6", "--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    config = run_config(args)
    assert config.rollout.rollout_batch_size == 4 and config.rollout.rollout_stop == ["END"]
    assert config.algorithm.use_critic is True  # derived by validation from --advantage-estimator ppo
    assert config.prompt_data.apply_chat_template_kwargs == {"enable_thinking": False}
    assert config.megatron.lr == 3e-6 and config.router.router_policy == "random"
    assert config.vllm.vllm_max_model_len == "256"  # as typed: vLLM's own parser reads it in the engine
    assert vars(config.namespace()) == vars(args)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rollout.rollout_batch_size = 8
    assert RolloutConfig.of(config.namespace()) == config.rollout


def test_a_value_of_the_wrong_type_or_an_entry_no_section_owns_is_refused_by_name(tiny_qwen3, arithmetic_data,
                                                                                  tmp_path):
    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), "--prompt-data", str(arithmetic_data[0]), "--rm-type",
                       "math", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"RolloutConfig: rollout_batch_size='8' is not int"):
        run_config(argparse.Namespace(**{**vars(args), "rollout_batch_size": "8"}))
    with pytest.raises(ValueError, match=r"RewardConfig: rm_timeout=True is not float"):  # a bool is no number
        run_config(argparse.Namespace(**{**vars(args), "rm_timeout": True}))
    with pytest.raises(ValueError, match=r"no config section owns rollout_batch_sise"):
        run_config(argparse.Namespace(**vars(args), rollout_batch_sise=8))


def test_a_section_of_a_partial_namespace_takes_the_missing_defaults_fresh():
    partial = SimpleNamespace(rm_timeout=2.0, custom_rm_path="my.reward", unrelated=1)
    rewards = RewardConfig.of(partial)
    assert rewards.rm_timeout == 2.0 and rewards.custom_rm_path == "my.reward"
    assert rewards.rm_max_retries == 3 and rewards.rm_num_workers is None  # the defaults --help shows
    first, second = RolloutConfig.of(partial), RolloutConfig.of(partial)
    assert first.rollout_stop is None and first == second
    from vime.config.agents import AgentConfig

    a, b = AgentConfig.of(partial), AgentConfig.of(partial)
    assert a.agent_tools == ["calculator", "python"] and a.agent_tools is not b.agent_tools


def _argument_modules():
    """The modules that declare vime's own flags by hand (not megatron_flags.py's generated ones)."""
    import vime.agents.arguments
    import vime.agents.openai_arguments
    import vime.algorithms.arguments
    import vime.arguments
    import vime.trainer.megatron.arguments
    import vime.trainer.megatron.routing_replay_arguments
    import vime.trainer.megatron.train_arguments
    import vime.engine.control.arguments
    import vime.environments.arguments
    import vime.rollout.arguments

    return (vime.arguments, vime.rollout.arguments, vime.trainer.megatron.arguments,
            vime.trainer.megatron.train_arguments, vime.trainer.megatron.routing_replay_arguments,
            vime.algorithms.arguments, vime.agents.arguments, vime.agents.openai_arguments,
            vime.environments.arguments, vime.engine.control.arguments)


def _add_argument_calls(tree: ast.AST):
    """(call, its destinations) of each add_argument call: from a literal dest= or option strings, or a for loop's
    literal tuple of options; None where the source does not say (options mirrored from another parser)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def dest(options: list[str]) -> str:
        return next((o for o in options if o.startswith("--")), options[0]).lstrip("-").replace("-", "_")

    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            continue
        keywords = {k.arg: k.value for k in call.keywords if k.arg}
        if isinstance(keywords.get("dest"), ast.Constant):
            yield call, [keywords["dest"].value]
        elif call.args and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in call.args):
            yield call, [dest([a.value for a in call.args])]
        elif call.args and isinstance(call.args[0], ast.Name):  # for flag, ... in (("--x", ...), ...): add(flag)
            loop = parents.get(call)
            while loop is not None and not isinstance(loop, ast.For):
                loop = parents.get(loop)
            names = [] if loop is None else [getattr(t, "id", None) for t in getattr(loop.target, "elts", [])]
            if call.args[0].id not in names or not isinstance(loop.iter, (ast.Tuple, ast.List)):
                yield call, None
                continue
            i = names.index(call.args[0].id)
            yield call, [dest([row.elts[i].value]) for row in loop.iter.elts]
        else:
            yield call, None


def _declared_by_field() -> set[str]:
    """The section flags written once, as a `flag()` field (`add_flags` declares them)."""
    from vime.config.section import FLAG

    return {f.name for cls in RunConfig.sections().values() for f in dataclasses.fields(cls) if FLAG in f.metadata}


def test_no_add_argument_call_of_a_section_flag_repeats_its_default():
    owned, seen, repeated = set(_owners()), _declared_by_field(), []
    for module in _argument_modules():
        path = inspect.getsourcefile(module)
        for call, dests in _add_argument_calls(ast.parse(Path(path).read_text(encoding="utf-8"))):
            for dest in set(dests or ()) & owned:
                seen.add(dest)
                if any(k.arg == "default" for k in call.keywords):
                    repeated.append(f"{module.__name__}:{call.lineno} {dest}")
    assert not repeated, f"a section holds these flags' defaults; drop default= from their add_argument: {repeated}"
    # the walk sees the call of every section flag but the two add_router_args mirrors from vllm-router's parser
    assert owned - seen == {"router_policy", "router_prometheus_port"}


def test_each_flag_group_alone_takes_its_sections_defaults_and_its_help_shows_them():
    from vime.agents.arguments import add_agent_args
    from vime.agents.openai_arguments import add_agent_harness_args
    from vime.algorithms.arguments import add_algorithm_args
    from vime.arguments import add_placement_args, add_run_args, add_wandb_args
    from vime.trainer.megatron.arguments import add_megatron_args
    from vime.trainer.megatron.routing_replay_arguments import add_routing_replay_args
    from vime.trainer.megatron.train_arguments import add_train_args
    from vime.environments.arguments import add_environment_args, add_judge_args
    from vime.rollout.arguments import add_all_rollout_args

    sections = RunConfig.sections()
    groups = {add_run_args: ["job"], add_wandb_args: ["wandb"], add_placement_args: ["placement"],
              add_all_rollout_args: ["prompt_data", "rollout", "engines", "fault_tolerance", "data_buffer", "rewards",
                                     "eval", "debug"],
              add_megatron_args: ["megatron"], add_train_args: ["train", "weight_sync", "lora"],
              add_routing_replay_args: ["routing_replay"],
              add_algorithm_args: ["algorithm", "rollout_correction", "distillation"], add_router_args: ["router"],
              add_agent_args: ["agents"], add_agent_harness_args: ["harness"],
              add_environment_args: ["environments"], add_judge_args: ["judge"]}
    assert sorted(n for names in groups.values() for n in names) == sorted(sections)
    for add, names in groups.items():
        parser = argparse.ArgumentParser(add_help=False)  # as the checkpoint converters and unit tests build one
        add(parser)
        parsed = vars(parser.parse_args([]))
        for name in names:
            defaults, flags = section_defaults(sections[name]), sections[name].flag_names()
            assert {f: parsed[f] for f in flags} == {f: defaults[f] for f in flags}, (add.__name__, name)
    router = {a.dest: a for a in build_parser()._actions}
    formatter = argparse.HelpFormatter("train.py")
    assert formatter._expand_help(router["router_policy"]).endswith("(default: round_robin)")  # not vllm-router's
    assert formatter._expand_help(router["router_prometheus_port"]).endswith("(default: None)")


@pytest.mark.parametrize("section, values, message", [
    ("JobConfig", {"train_timeout": 0}, r"--train-timeout must be a positive number of seconds, got 0"),
    ("PlacementConfig", {"offload_train": True}, r"--offload-train only makes sense with --colocate"),
    ("WandbConfig", {"wandb_mode": "offline"}, r"--wandb-mode only take effect with --use-wandb"),
    ("DebugConfig", {"save_debug_rollout_data": "x.pt"}, r"--save-debug-rollout-data 'x.pt' must contain"),
    ("RolloutConfig", {"n_samples_per_prompt": 0}, r"--n-samples-per-prompt must be >= 1, got 0"),
    ("EnginesConfig", {"engine_startup_timeout": -1.0}, r"--engine-startup-timeout must be a positive number"),
    ("FaultToleranceConfig", {"max_failed_samples_ratio": 1.5}, r"--max-failed-samples-ratio must be in \[0, 1\]"),
    ("EvalConfig", {"eval_pass_at_k": [4]}, r"k = 4 needs --n-samples-per-eval-prompt >= 4 \(got 1\)"),
    ("TrainLoopConfig", {"use_dynamic_batch_size": True}, r"--use-dynamic-batch-size needs --max-tokens-per-gpu"),
    ("WeightSyncConfig", {"update_weight_buffer_size": 0}, r"--update-weight-buffer-size must be >= 1 byte"),
    ("LoraConfig", {"lora_dropout": 1.0}, r"--lora-dropout must be in \[0, 1\), got 1.0"),
    ("JudgeConfig", {"judge_checkpoint": "j", "judge_concurrency": 0}, r"--judge-concurrency must be >= 1, got 0"),
    ("RolloutConfig", {"over_sampling_batch_size": 16, "rollout_batch_size": 32},
     r"--over-sampling-batch-size \(16\) must be >= --rollout-batch-size \(32\)"),
    ("RolloutConfig", {"mask_offpolicy_in_partial_rollout": True}, r"needs --partial-rollout"),
    ("EnginesConfig", {"rollout_num_gpus": 3, "rollout_num_gpus_per_engine": 2}, r"must be a multiple of"),
    ("EnginesConfig", {"rollout_external_engine_addrs": ["localhost"]}, r"'localhost' is not host:port"),
    ("EvalConfig", {"eval_prompt_data": ["aime"]}, r"--eval-prompt-data takes pairs NAME PATH"),
    ("AlgorithmConfig", {"eps_clip_c": 1.0}, r"--eps-clip-c must be > 1.0"),
    ("AlgorithmConfig", {"overlong_penalty_factor": 0.5}, r"--overlong-penalty-factor needs --overlong-buffer-len"),
    ("AlgorithmConfig", {"entropy_top_fraction": 0.0}, r"--entropy-top-fraction must lie in \(0, 1\], got 0.0"),
    ("RolloutCorrectionConfig", {"use_tis": True, "use_mis": True}, r"--use-mis and --use-tis are mutually exclusive"),
    ("RolloutCorrectionConfig", {"mis_threshold_low": 2.0}, r"0 <= --mis-threshold-low \(2.0\) < --mis-threshold-high"),
    ("DistillationConfig", {"opd_teacher_checkpoint": "t", "opd_coef": 0.0}, r"--opd-coef must be > 0, got 0.0"),
])
def test_each_section_refuses_its_own_bad_values_by_flag_name(section, values, message):
    from vime.config.run_config import SECTIONS

    cls = SECTIONS[section]
    cls().check()  # the defaults pass
    with pytest.raises(ValueError, match=message):
        cls(**values).check()



@dataclasses.dataclass(frozen=True)
class Toy(Section):
    """A section of every kind of flag `add_flags` declares."""

    toy_count: int = flag(3, "How many (default: %(default)s).")
    toy_scale: float | None = flag(None, "A scale.")
    toy_on: bool = flag(False, "A switch.")
    toy_keep: bool = flag(True, "On unless --no-toy-keep.", action=argparse.BooleanOptionalAction)
    toy_names: list[str] = flag(["a", "b"], "Names.")
    toy_ks: list[int] | None = flag(None, "Ks.", metavar="K")
    toy_mode: Literal["x", "y"] = flag("x", "A mode.")
    toy_pair: tuple | None = flag(None, "Two ints.", parse=lambda text: tuple(map(int, text.split(","))))
    toy_derived: int = 0  # no flag(): not on the command line


def test_a_flag_is_written_once_as_its_field():
    """`add_flags` reads a flag's whole declaration off its field: the option from the name, the default, the help,
    and from the annotation a switch (bool), one-or-more values (list), choices (Literal), the parser (int, float)."""
    parser = argparse.ArgumentParser()
    add_flags(parser, Toy)
    defaults = parser.parse_args([])
    assert Toy.of(defaults) == Toy() and defaults.toy_names == ["a", "b"] and not hasattr(defaults, "toy_derived")
    assert Toy().toy_names is not Toy().toy_names  # a list default is fresh per use
    given = parser.parse_args(["--toy-count", "5", "--toy-scale", "0.5", "--toy-on", "--no-toy-keep", "--toy-names",
                               "c", "--toy-ks", "1", "4", "--toy-mode", "y", "--toy-pair", "2,3"])
    assert Toy.of(given) == Toy(5, 0.5, True, False, ["c"], [1, 4], "y", (2, 3))
    with pytest.raises(SystemExit):
        parser.parse_args(["--toy-mode", "z"])
    help_text = " ".join(parser.format_help().split())
    assert "How many (default: 3)." in help_text and "--toy-ks K [K ...]" in help_text and "{x,y}" in help_text
