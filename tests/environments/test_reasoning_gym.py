"""reasoning-gym datasets as environments: prompts from the entries (train, then eval after them), exact scoring
with the dataset's own scorer, configs and weights, and the errors a wrong spec gives."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from vime.data.sample import Sample
from vime.environments.mixture import environment_specs, load_environments

reasoning_gym = pytest.importorskip("reasoning_gym")

CONFIG = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def _args(environment=("reasoning_gym:chain_sum,basic_arithmetic",), config=None, **kw):
    base = dict(environment=list(environment), environment_weights=None,
                environment_args=[config] if config else None, environment_eval_size=3, reasoning_gym_size=5,
                reasoning_gym_seed=7, reasoning_gym_weights=None, reasoning_gym_system_prompt="none", seed=0,
                apply_chat_template=True, apply_chat_template_kwargs=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def test_prompts_and_exact_scores(tokenizer):
    import json

    args = _args(config=json.dumps(CONFIG), reasoning_gym_weights=[3.0, 1.0])
    envs = load_environments(args)
    assert [(e.name, e.weight) for e in envs] == [("chain_sum", 0.75), ("basic_arithmetic", 0.25)]
    chain = envs[0]
    data = reasoning_gym.create_dataset("chain_sum", size=8, seed=7, **CONFIG["chain_sum"])
    train, evals = chain.train_prompts(tokenizer, args), chain.eval_prompts(tokenizer, args, 3)
    assert [p.metadata["reasoning_gym"]["index"] for p in train + evals] == list(range(8))
    for prompt in train + evals:
        entry = data[prompt.metadata["reasoning_gym"]["index"]]
        text = tokenizer.apply_chat_template([{"role": "user", "content": entry["question"]}],
                                             add_generation_prompt=True, tokenize=False)
        assert prompt.tokens == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert prompt.label == entry["answer"] and prompt.metadata["environment"] == "chain_sum"
        assert len(entry["metadata"]["expression"].split()) == 3  # the config holds: a op b

    def score(response):
        sample = Sample(response=response, metadata=dict(train[1].metadata))
        return asyncio.run(chain.score(None, sample)), sample

    answer = data[1]["answer"]
    value, sample = score(f"<answer>{answer}</answer><|im_end|>")
    assert value == 1.0 and sample.metadata["reward_functions"] == {"score_answer": 1.0}
    assert sample.metadata["reward_weights"] == {"score_answer": 1.0} and sample.metadata["eval_answer"] == answer
    assert score(f"{answer}")[0] == 0.0  # no <answer> tags: reasoning-gym's extract_answer finds nothing
    assert score(f"<answer>{int(answer) + 1}</answer>")[0] == 0.0
    with pytest.raises(ValueError, match="eval entries asked"):
        chain.eval_prompts(tokenizer, args, 4)


def test_system_prompt_and_plain_prompts(tokenizer):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    args = _args(environment=["reasoning_gym:chain_sum"], reasoning_gym_system_prompt="direct",
                 apply_chat_template=False)
    prompt = load_environments(args)[0].train_prompts(tokenizer, args)[0]
    assert prompt.prompt.startswith(SYSTEM_PROMPTS["direct"] + "\n")


@pytest.mark.parametrize("environment, config, match", [
    (["reasoning_gym:no_such_dataset"], None, "reasoning_gym:no_such_dataset: ValueError: Dataset 'no_such"),
    (["reasoning_gym:chain_sum"], '{"chain_sum": {"bogus": 1}}', "reasoning_gym:chain_sum: TypeError"),
    (["reasoning_gym:chain_sum"], '{"chain_sum": {"min_terms": 0}}', "min_terms must be positive"),
    (["reasoning_gym:chain_sum"], '{"other": {}}', "keys other name no dataset"),
    (["reasoning_gym:chain_sum"], '{"system_prompt": "mine"}', "system prompt 'mine': not one of none"),
])
def test_bad_specs_are_clear_errors(environment, config, match):
    with pytest.raises(ValueError, match=match):
        load_environments(_args(environment=environment, config=config))


def test_missing_library_names_the_extra(monkeypatch):
    import sys

    from vime.environments.base import MissingExtraError

    for name in ("reasoning_gym", "reasoning_gym.utils"):
        monkeypatch.setitem(sys.modules, name, None)  # what an uninstalled package looks like to an import
    with pytest.raises(MissingExtraError) as e:
        load_environments(_args(environment=["reasoning_gym:chain_sum"]))
    assert "\n" not in str(e.value) and "pip install -e '.[envs]'" in str(e.value)
    assert "reasoning-gym package" in str(e.value)


def test_flags_validation(tiny_qwen3, tmp_path, capsys):
    from vime.arguments import parse_args

    def parse(*extra):
        return parse_args(["--hf-checkpoint", str(tiny_qwen3), "--output-dir", str(tmp_path), *extra],
                          check_model=False)

    args = parse("--environment", "reasoning_gym:chain_sum")
    assert args.custom_rm_path == "vime.environments.hooks.reward" and args.custom_generate_function_path is None
    assert environment_specs(args)[0].target == "chain_sum"
    for extra, message in [
        (("--environment", "reasoning_gym:chain_sum", "--rm-type", "math"), "drop --rm-type"),
        (("--environment", "gym:x"), "unknown kind 'gym'"),
        (("--environment", "reasoning_gym:a", "--environment-weights", "1", "2"), "2 weights for 1"),
        (("--environment-args", "{}",), "--environment-args needs --environment"),
        (("--environment", "reasoning_gym:a", "--environment", "reasoning_gym:b", "--reasoning-gym-weights", "1"),
         "with several, weigh the specs"),
    ]:
        with pytest.raises(SystemExit):
            parse(*extra)
        assert message in capsys.readouterr().err
