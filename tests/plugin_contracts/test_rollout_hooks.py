"""Contract tests for every rollout-side function-path hook: the signatures users write against (slime's), how
vime calls them and what it does with what they return. Generation here is a user-style custom generate
function (no engine); the real engine path is covered by tests/e2e."""

from __future__ import annotations

import inspect
import sys
import textwrap
from types import SimpleNamespace

import pytest

from vime.data.data_source import RolloutDataSource
from vime.data.sample import Sample
from vime.rollout import vllm_rollout
from vime.rollout.vllm_rollout import GenerateState, generate_and_rm_group, generate_rollout_async

PLUGIN = textwrap.dedent('''
    import asyncio
    from vime.rollout.filter_hub.dynamic_sampling_filters import DynamicFilterOutput

    CALLS = []

    async def generate(args, sample, sampling_params):
        CALLS.append(("generate", sample.index, dict(sampling_params)))
        answer = str(sample.index % 2)   # odd samples answer "1", even ones "0"
        sample.tokens = sample.tokens + [7, 8]
        sample.response_length += 2
        sample.response = answer
        sample.rollout_log_probs = [-0.1, -0.2]
        sample.loss_mask = [1, 1]
        return sample

    async def reward(args, sample):
        return float(sample.response == sample.label)

    def sync_reward(args, sample):
        return 0.5

    async def group_reward(args, samples):
        return [float(i) for i, _ in enumerate(samples)]

    async def bad_group_reward(args, samples):
        return [1.0]

    async def raising_reward(args, sample):
        if sample.index % 2:
            raise KeyError("no such field")
        return 1.0

    async def slow_reward(args, sample):
        await asyncio.sleep(5)
        return 1.0

    async def wrong_type_generate(args, sample, sampling_params):
        return {"tokens": [1]}

    async def failing_generate(args, sample, sampling_params):
        raise ConnectionError("engine went away")

    def keep_first_of_pair(args, samples, **kwargs):
        keep = samples[0].group_index % 2 == 0
        return DynamicFilterOutput(keep=keep, reason=None if keep else "odd_group")

    def post_process(args, samples):
        for s in samples:
            s.metadata["post_processed"] = True
''')


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_plugin", None)
    GenerateState.reset()
    yield __import__("my_plugin")
    GenerateState.reset()
    sys.modules.pop("my_plugin", None)


def _args(tiny_qwen3, **kw):
    base = dict(hf_checkpoint=str(tiny_qwen3), rollout_concurrency=4, custom_generate_function_path="my_plugin.generate",
                rm_type=None, custom_rm_path="my_plugin.reward", group_rm=False, rm_timeout=2.0, reward_key=None,
                rollout_seed=0, seed=0, custom_reward_post_process_path=None, rollout_batch_size=2,
                over_sampling_batch_size=2, dynamic_sampling_filter_path=None, max_dynamic_sampling_rounds=4,
                rollout_temperature=0.9, rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=16,
                rollout_stop=None, rollout_stop_token_ids=None, rollout_engine_urls=[], partial_rollout=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _source(n_prompts=6, n=2):
    prompts = [Sample(prompt=f"p{i}", tokens=[1, 2, 3], label="1") for i in range(n_prompts)]
    return RolloutDataSource(prompts, n_samples_per_prompt=n, seed=0, shuffle=False)


def _run(coro):
    from vime.utils.async_utils import run

    return run(coro)


def test_default_hook_signatures_match_slime():
    assert list(inspect.signature(vllm_rollout.generate_rollout).parameters) == [
        "args", "rollout_id", "data_source", "evaluation"]
    assert list(inspect.signature(vllm_rollout.generate).parameters) == ["args", "sample", "sampling_params"]
    from vime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
    from vime.rollout.rm_hub import async_rm, batched_async_rm

    assert list(inspect.signature(async_rm).parameters)[:2] == ["args", "sample"]
    assert list(inspect.signature(batched_async_rm).parameters)[:2] == ["args", "samples"]
    assert list(inspect.signature(check_reward_nonzero_std).parameters)[:2] == ["args", "samples"]


def test_custom_generate_and_reward(plugin, tiny_qwen3):
    args = _args(tiny_qwen3)
    group = _source().get_samples(1)[0]
    out = _run(generate_and_rm_group(args, group, vllm_rollout.sampling_params_for(
        SimpleNamespace(**vars(args), eval_temperature=None))))
    assert [s.reward for s in out] == [0.0, 1.0]  # sample 0 answers "0", sample 1 answers "1"
    assert all(s.status == Sample.Status.COMPLETED for s in out)
    _, _, params = plugin.CALLS[0]
    assert params["temperature"] == 0.9 and params["max_tokens"] == 16 and params["logprobs"] == 0
    assert "seed" in params  # per-request seed for reproducibility
    assert len({c[2]["seed"] for c in plugin.CALLS}) == 2


def test_sync_reward_function_is_accepted(plugin, tiny_qwen3):
    args = _args(tiny_qwen3, custom_rm_path="my_plugin.sync_reward")
    out = _run(generate_and_rm_group(args, _source().get_samples(1)[0], {"max_tokens": 4}))
    assert [s.reward for s in out] == [0.5, 0.5]


def test_group_reward_gets_the_whole_group(plugin, tiny_qwen3):
    args = _args(tiny_qwen3, custom_rm_path="my_plugin.group_reward", group_rm=True)
    out = _run(generate_and_rm_group(args, _source(n=3).get_samples(1)[0], {"max_tokens": 4}))
    assert [s.reward for s in out] == [0.0, 1.0, 2.0]


def test_group_reward_wrong_length_fails_the_group(plugin, tiny_qwen3):
    args = _args(tiny_qwen3, custom_rm_path="my_plugin.bad_group_reward", group_rm=True)
    out = _run(generate_and_rm_group(args, _source(n=3).get_samples(1)[0], {"max_tokens": 4}))
    assert all(s.status == Sample.Status.FAILED for s in out)
    assert "1 rewards for 3 samples" in out[0].metadata["failure"]["error"]


def test_raising_and_hanging_rewards_are_recorded_per_sample(plugin, tiny_qwen3):
    out = _run(generate_and_rm_group(_args(tiny_qwen3, custom_rm_path="my_plugin.raising_reward"),
                                     _source().get_samples(1)[0], {"max_tokens": 4}))
    assert out[0].reward == 1.0 and out[0].status == Sample.Status.COMPLETED
    assert out[1].status == Sample.Status.FAILED
    assert out[1].metadata["failure"] == {"stage": "reward", "reason": "error", "error": "KeyError: 'no such field'"}
    out = _run(generate_and_rm_group(_args(tiny_qwen3, custom_rm_path="my_plugin.slow_reward", rm_timeout=0.2),
                                     _source().get_samples(1)[0], {"max_tokens": 4}))
    assert all(s.status == Sample.Status.FAILED and "--rm-timeout" in s.metadata["failure"]["error"] for s in out)


@pytest.mark.parametrize("fn, message", [("my_plugin.wrong_type_generate", "returned dict, expected Sample"),
                                         ("my_plugin.failing_generate", "ConnectionError: engine went away")])
def test_bad_generate_functions_fail_the_sample(plugin, tiny_qwen3, fn, message):
    out = _run(generate_and_rm_group(_args(tiny_qwen3, custom_generate_function_path=fn),
                                     _source().get_samples(1)[0], {"max_tokens": 4}))
    assert all(s.status == Sample.Status.FAILED and message in s.metadata["failure"]["error"] for s in out)


def test_dynamic_sampling_filter_and_post_process(plugin, tiny_qwen3):
    args = _args(tiny_qwen3, rollout_batch_size=3, over_sampling_batch_size=4,
                 dynamic_sampling_filter_path="my_plugin.keep_first_of_pair",
                 custom_reward_post_process_path="my_plugin.post_process")
    output = vllm_rollout.generate_rollout(args, 0, _source(n_prompts=20))  # the manager's entry
    groups, metrics = output.samples, output.metrics
    assert len(groups) == 3 and all(g[0].group_index % 2 == 0 for g in groups)
    assert [g[0].group_index for g in groups] == sorted(g[0].group_index for g in groups)
    assert metrics["rollout/dropped/odd_group"] == metrics["rollout/dropped_groups"] >= 2
    submitted = metrics["rollout/submitted_groups"]  # whole over-sampling rounds of 4
    assert submitted % 4 == 0 and submitted >= len(groups) + metrics["rollout/dropped_groups"]
    assert metrics["rollout/max_in_flight"] == metrics["rollout/request_retries"] == 0  # the plugin sent no request
    assert all(s.metadata["post_processed"] for g in groups for s in g)


def test_rollout_functions_may_return_bare_groups_or_outputs():
    from vime.data.sample import RolloutFnEvalOutput, RolloutFnTrainOutput, as_rollout_output

    groups = [[Sample(prompt="p")]]
    assert as_rollout_output(groups, evaluation=False) == RolloutFnTrainOutput(groups, None)
    full = RolloutFnTrainOutput(groups, {"rollout/x": 1.0})
    assert as_rollout_output(full, evaluation=False) is full
    assert as_rollout_output({"set": groups[0]}, evaluation=True) == RolloutFnEvalOutput({"set": groups[0]})


def test_dynamic_sampling_gives_up_with_a_clear_error(plugin, tiny_qwen3, tmp_path):
    (tmp_path / "reject_all.py").write_text(
        "from vime.rollout.filter_hub.dynamic_sampling_filters import DynamicFilterOutput\n"
        "def f(args, samples, **kw):\n    return DynamicFilterOutput(keep=False, reason='never')\n")
    args = _args(tiny_qwen3, dynamic_sampling_filter_path="reject_all.f", max_dynamic_sampling_rounds=2)
    with pytest.raises(RuntimeError, match="only 0/2 groups passed the dynamic sampling filter after 2 rounds"):
        _run(generate_rollout_async(args, 0, _source(n_prompts=20)))
