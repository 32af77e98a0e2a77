"""The run's typed config (vime/config): its sections and the parser agree flag by flag, every default has its
field's type, a parsed run builds a frozen config whose slime-style view is the namespace it came from, and a
wrong value or an unowned entry is refused by name."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from vime.arguments import _dests, build_parser, parse_args, run_config
from vime.backends.megatron_utils.megatron_flags import add_generated_megatron_args
from vime.backends.vllm_utils.arguments import add_router_args, add_vllm_engine_args
from vime.config import RunConfig
from vime.config.rollout import RewardConfig, RolloutConfig
from vime.config.section import check_types, section_defaults


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
