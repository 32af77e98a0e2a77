"""--partial-rollout: groups cut off when the batch fills keep their tokens and are continued first in the next
rollout; --mask-offpolicy-in-partial-rollout keeps the pre-abort tokens out of training; --buffer-filter-path
chooses which kept groups go next. Generation here is a user-style generate function that stops early when the
rollout is aborted, as a vLLM engine does (finish_reason "abort" with the tokens so far)."""

from __future__ import annotations

import sys
import textwrap
import pytest

from tests.plugin_contracts.test_rollout_hooks import _args, _run
from vime.data.data_source import RolloutDataSource
from vime.data.sample import Sample
from vime.rollout.vllm_rollout import GenerateState, generate_rollout_async

PLUGIN = textwrap.dedent('''
    import asyncio
    from vime.rollout.vllm_rollout import GenerateState
    from vime.data.sample import Sample

    LENGTH = 4

    async def generate(args, sample, sampling_params):
        state = GenerateState(args)
        while sample.response_length < LENGTH:
            if state.aborted:
                sample.status = Sample.Status.ABORTED
                return sample
            await asyncio.sleep(0.05 if sample.group_index >= 2 else 0.02)  # groups 0, 1 are fast
            sample.tokens = sample.tokens + [7]
            sample.response_length += 1
            sample.rollout_log_probs = (sample.rollout_log_probs or []) + [-0.5]
            sample.loss_mask = (sample.loss_mask or []) + [1]
        sample.response = "1"
        sample.status = Sample.Status.COMPLETED
        return sample

    def newest_first(args, buffer, num_groups):
        taken = buffer[::-1][:num_groups]
        for g in taken:
            buffer.remove(g)
        return taken
''')


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    (tmp_path / "partial_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("partial_plugin", None)
    GenerateState.reset()
    yield __import__("partial_plugin")
    GenerateState.reset()


def _source(buffer_filter=None):
    prompts = [Sample(prompt=f"p{i}", tokens=[1, 2, 3], label="1") for i in range(20)]
    return RolloutDataSource(prompts, 2, seed=0, shuffle=False, buffer_filter=buffer_filter)


def _partial_args(tiny_qwen3, **kw):
    return _args(tiny_qwen3, custom_generate_function_path="partial_plugin.generate", rm_type="exact_match",
                 custom_rm_path=None, rollout_batch_size=2,
                 over_sampling_batch_size=4, partial_rollout=True, mask_offpolicy_in_partial_rollout=False, **kw)


def test_cut_off_groups_continue_next_rollout(plugin, tiny_qwen3):
    args = _partial_args(tiny_qwen3)
    source = _source()
    first, stats = _run(generate_rollout_async(args, 0, source))
    assert [g[0].group_index for g in first] == [0, 1] and stats["aborted_groups"] == 2
    kept = [s for g in source.buffer for s in g]
    assert {s.group_index for s in kept} == {2, 3}
    assert all(s.status == Sample.Status.ABORTED and 0 < s.response_length < 4 for s in kept)
    done_before = {s.index: s.response_length for s in kept}

    second, _ = _run(generate_rollout_async(args, 1, source))
    resumed = [s for g in second for s in g if s.index in done_before]
    assert {s.group_index for s in resumed} == {2, 3}  # served before any fresh prompt
    for s in resumed:
        assert s.response_length == 4 and s.status == Sample.Status.COMPLETED and s.reward == 1.0
        assert s.metadata["partial_rollout_resumed"] == 1
        assert s.loss_mask == [1, 1, 1, 1] and len(s.tokens) == 3 + 4


def test_mask_offpolicy_tokens(plugin, tiny_qwen3):
    args = _partial_args(tiny_qwen3)
    args.mask_offpolicy_in_partial_rollout = True
    source = _source()
    _run(generate_rollout_async(args, 0, source))
    before = {s.index: s.response_length for g in source.buffer for s in g}
    second, _ = _run(generate_rollout_async(args, 1, source))
    for s in (s for g in second for s in g if s.index in before):
        k = before[s.index]
        assert s.loss_mask == [0] * k + [1] * (4 - k)


def test_without_partial_rollout_cut_off_groups_are_dropped(plugin, tiny_qwen3):
    args = _partial_args(tiny_qwen3)
    args.partial_rollout = False
    source = _source()
    _run(generate_rollout_async(args, 0, source))
    assert source.buffer == []


def test_buffer_filter_chooses_what_goes_next(plugin, tiny_qwen3):
    args = _partial_args(tiny_qwen3)
    source = _source(buffer_filter=lambda buffer, n: plugin.newest_first(args, buffer, n))
    source.add_samples([[Sample(prompt="old", tokens=[1], group_index=100, index=1000)]])
    source.add_samples([[Sample(prompt="new", tokens=[1], group_index=101, index=1001)]])
    assert [g[0].prompt for g in source.get_samples(1)] == ["new"]
    assert [g[0].prompt for g in source.get_samples(1)] == ["old"]
