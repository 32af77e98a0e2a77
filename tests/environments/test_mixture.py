"""The environment mixture around any kind: spec parsing, weighted draws, resume, per-environment metrics, the
generate/reward hooks' dispatch and failures. Fake environments: no library needed."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import pytest

from vime.data.sample import Sample
from vime.environments import hooks
from vime.environments.base import Environment, parse_spec, record_functions
from vime.environments.mixture import EnvironmentMixSource, environment_specs, load_environments
from vime.rollout.context import reset_rollout_context
from vime.rollout.metrics import ENVIRONMENT_KEY, rollout_metrics


def _prompts(name, n):
    return [Sample(prompt=f"{name}{i}", tokens=[i + 1], label=str(i), metadata={ENVIRONMENT_KEY: name})
            for i in range(n)]


def test_spec_parsing_and_errors():
    assert parse_spec("reasoning_gym:a,b", 2.0, {"a": {}}).target == "a,b"
    with pytest.raises(ValueError, match="expected KIND:TARGET"):
        parse_spec("reasoning_gym")
    with pytest.raises(ValueError, match="unknown kind 'gym'"):
        parse_spec("gym:x")
    assert parse_spec("verifiers:my_env", 1.5, {"size": 4}).kind == "verifiers"
    with pytest.raises(ValueError, match="weight must be > 0"):
        parse_spec("openenv:x", 0.0)
    args = SimpleNamespace(environment=["reasoning_gym:m", "openenv:n"], environment_weights=[3.0, 1.0],
                           environment_args=['{"k": 1}', "{}"])
    specs = environment_specs(args)
    assert [(s.kind, s.target, s.weight, s.config) for s in specs] == [("reasoning_gym", "m", 3.0, {"k": 1}),
                                                                        ("openenv", "n", 1.0, {})]
    with pytest.raises(ValueError, match="2 JSON objects for 1"):
        environment_specs(SimpleNamespace(environment=["openenv:n"], environment_weights=None,
                                          environment_args=["{}", "{}"]))
    with pytest.raises(ValueError, match="not valid JSON"):
        environment_specs(SimpleNamespace(environment=["openenv:n"], environment_weights=None,
                                          environment_args=["{bad"]))
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        environment_specs(SimpleNamespace(environment=["openenv:n"], environment_weights=None,
                                          environment_args=["[1]"]))


def test_weighted_draws_follow_the_weights_and_tag_samples():
    source = EnvironmentMixSource({"a": _prompts("a", 5), "b": _prompts("b", 3)}, {"a": 3.0, "b": 1.0},
                                  n_samples_per_prompt=2, seed=0, shuffle=True)
    groups = source.get_samples(8) + source.get_samples(4)
    names = [g[0].metadata[ENVIRONMENT_KEY] for g in groups]
    assert names.count("a") == 9 and names.count("b") == 3
    # smooth: never more than one group away from its share after any prefix
    for n in range(1, len(names) + 1):
        assert abs(names[:n].count("a") - 0.75 * n) <= 1
    assert [s.index for g in groups for s in g] == list(range(24))
    assert all(len(g) == 2 and g[0].prompt == g[1].prompt for g in groups)
    # each environment runs through its own prompts epoch by epoch: 9 groups of a = all 5 once, then 4 more
    a_prompts = [g[0].prompt for g in groups if g[0].metadata[ENVIRONMENT_KEY] == "a"]
    assert sorted(a_prompts[:5]) == [f"a{i}" for i in range(5)]


def test_resume_continues_the_same_draws():
    def make():
        return EnvironmentMixSource({"a": _prompts("a", 4), "b": _prompts("b", 4)}, {"a": 1.0, "b": 2.0}, 1, 7, True)

    one = make()
    one.get_samples(5)
    state = one.state_dict()
    expected = [(g[0].prompt, g[0].index) for g in one.get_samples(6)]
    two = make()
    two.load_state_dict(state)
    assert [(g[0].prompt, g[0].index) for g in two.get_samples(6)] == expected


def test_environment_metrics_per_environment_and_function():
    samples = []
    for i, (env, reward) in enumerate([("a", 1.0), ("a", 0.0), ("b", 0.5), ("b", None)]):
        s = Sample(index=i, response_length=2, reward=reward, status=Sample.Status.COMPLETED,
                   metadata={ENVIRONMENT_KEY: env})
        if reward is not None:
            record_functions(s, {"exact": reward, "fmt": 1.0}, {"exact": 1.0, "fmt": 0.2})
        else:
            s.status = Sample.Status.FAILED
            s.metadata["failure"] = {"stage": "reward", "reason": "error"}
        samples.append(s)
    m = rollout_metrics(samples, SimpleNamespace(reward_key=None), prefix="eval/x")
    assert m["eval/x/env/a/reward_mean"] == 0.5 and m["eval/x/env/a/num_samples"] == 2
    assert m["eval/x/env/b/reward_mean"] == 0.5 and m["eval/x/env/b/failed_samples"] == 1
    assert m["eval/x/env/a/fn/exact_mean"] == 0.5 and m["eval/x/env/a/fn/fmt_weight"] == pytest.approx(0.2)
    assert m["eval/x/env/b/fn/exact_mean"] == 0.5  # only the scored sample reports its functions
    assert not any("/env/" in k for k in rollout_metrics([Sample(reward=1.0)], None, "eval/y"))
    own = rollout_metrics(samples[:2], SimpleNamespace(reward_key=None), prefix="eval/a")  # a's own eval set
    assert own["eval/a/fn/exact_mean"] == 0.5 and own["eval/a/reward_mean"] == 0.5
    assert not any("/env/" in k for k in own)


class _Env(Environment):
    def __init__(self, name, fail=False):
        self.name, self.fail, self.closed = name, fail, False

    async def score(self, args, sample):
        if self.fail:
            raise ZeroDivisionError("rubric bug")
        record_functions(sample, {"len": float(len(sample.response))}, {"len": 1.0})
        return float(len(sample.response))

    def close(self):
        self.closed = True


def test_reward_hook_dispatches_and_a_raising_rubric_fails_only_its_sample():
    from vime.rollout.vllm_rollout import _reward_one

    context = reset_rollout_context()
    context.environments = {"ok": _Env("ok"), "bad": _Env("bad", fail=True)}
    args = SimpleNamespace(custom_rm_path=hooks.REWARD_PATH, rm_timeout=5.0, lora_adapters=None,
                           custom_rm_in_workers=False)
    good = Sample(index=0, response="abc", metadata={ENVIRONMENT_KEY: "ok"})
    bad = Sample(index=1, response="abc", response_length=3, metadata={ENVIRONMENT_KEY: "bad"})
    unknown = Sample(index=2, response="x", response_length=1, metadata={ENVIRONMENT_KEY: "gone"})

    async def score_all():
        for s in (good, bad, unknown):
            await _reward_one(args, s)

    asyncio.run(score_all())
    assert good.reward == 3.0 and good.metadata["reward_functions"] == {"len": 3.0}
    assert bad.status == Sample.Status.FAILED and bad.metadata["failure"]["stage"] == "reward"
    assert "ZeroDivisionError: rubric bug" in bad.metadata["failure"]["error"] and bad.loss_mask == [0, 0, 0]
    assert "environment 'gone'" in unknown.metadata["failure"]["error"]
    assert asyncio.run(hooks.reward(args, [good])) == [3.0]  # --group-rm: the group's environment
    reset_rollout_context()


def test_duplicate_names_are_refused_and_environments_closed(monkeypatch):
    made = []

    def fake_load(spec, args):
        made.append(_Env(spec.target.split(",")[0]))
        return [made[-1]]

    import vime.environments.reasoning_gym_env as rg_env

    monkeypatch.setattr(rg_env, "load", fake_load)
    args = argparse.Namespace(environment=["reasoning_gym:x", "reasoning_gym:x"], environment_weights=None,
                              environment_args=None)
    with pytest.raises(ValueError, match="two environments are named x"):
        load_environments(args)
    assert len(made) == 2 and all(e.closed for e in made)
