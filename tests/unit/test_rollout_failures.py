"""Failures on the rollout side, without engines: the generate request's retries against a fake HTTP engine
(4xx fails the sample at once, 5xx and dropped connections are retried, the in-flight peak is counted), reward
functions that block past --rm-timeout or return the wrong type, failure metrics by reason and the counters."""

from __future__ import annotations

import asyncio
import textwrap
import time
from types import SimpleNamespace

import pytest
from aiohttp import web

from tests.helpers.plugins import rollout_plugin, run as _run
from vime.rollout.context import reset_rollout_context, rollout_context
from vime.rollout.generation import post_generate, retry_window_s
from vime.rollout.metrics import add_counter, record_counters, rollout_metrics
from vime.rollout.vllm_rollout import (EngineRejectedError, EngineUnavailableError, GenerateState,
                                       generate_and_rm_group)
from vime.data.sample import Sample

PLUGIN = textwrap.dedent('''
    import time

    def blocking_reward(args, sample):  # sync and blocking: must not stall the event loop
        if sample.index % 2:
            time.sleep(2)
        return 1.0

    def none_reward(args, sample):
        return None

    def bool_filter(args, samples):
        return True

    async def generate(args, sample, sampling_params):
        sample.tokens = sample.tokens + [5]
        sample.response_length += 1
        sample.loss_mask = [1]
        sample.rollout_log_probs = [-0.5]
        return sample
''')


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    with rollout_plugin(tmp_path, monkeypatch, "failure_plugin", PLUGIN):
        yield


def _args(tiny_qwen3, **kw):
    base = dict(hf_checkpoint=str(tiny_qwen3), rollout_concurrency=64, rollout_request_timeout=5.0,
                rollout_request_retries=3, use_fault_tolerance=False, custom_generate_function_path=None,
                rm_type=None, custom_rm_path=None, group_rm=False, rm_timeout=2.0, reward_key=None, rollout_seed=0,
                custom_reward_post_process_path=None, vllm_router_ip="127.0.0.1", vllm_router_port=None,
                rollout_health_check_interval=1.0, rollout_health_check_timeout=1.0)
    base.update(kw)
    return SimpleNamespace(**base)


class FakeEngine:
    """An HTTP server answering /inference/v1/generate from a script of statuses ('drop' closes the connection)."""

    def __init__(self, script: list):
        self.script, self.calls, self.concurrent, self.peak = list(script), 0, 0, 0
        self.payloads = []

    async def handle(self, request):
        self.calls += 1
        self.payloads.append(await request.json())
        n = self.payloads[-1]["sampling_params"].get("n") or 1
        self.concurrent += 1
        self.peak = max(self.peak, self.concurrent)
        try:
            await asyncio.sleep(0.2)
            status = self.script.pop(0) if self.script else 200
            if status == "drop":
                request.transport.close()
                return web.Response(status=200)
            if status != 200:
                return web.json_response({"error": f"status {status}"}, status=status)
            return web.json_response({"choices": [{"index": k, "token_ids": [1 + k],
                                                   "logprobs": {"content": [{"logprob": -1.0}]},
                                                   "finish_reason": "length"} for k in range(n)]})
        finally:
            self.concurrent -= 1

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]


async def _serve_and_post(args, script, n_requests=1):
    engine = FakeEngine(script)
    rollout_context().router_url = f"http://127.0.0.1:{await engine.start()}"
    try:
        results = await asyncio.gather(*(post_generate(args, [1, 2], {"max_tokens": 1}) for _ in range(n_requests)),
                                       return_exceptions=True)
    finally:
        await engine.runner.cleanup()
    return engine, results


def test_bad_request_fails_at_once_and_server_errors_are_retried(tiny_qwen3, plugin):
    engine, [result] = _run(_serve_and_post(_args(tiny_qwen3), [400]))
    assert isinstance(result, EngineRejectedError) and "HTTP 400" in str(result) and engine.calls == 1
    args = _args(tiny_qwen3)
    engine, [result] = _run(_serve_and_post(args, [503, "drop", 502]))
    assert result["token_ids"] == [1] and engine.calls == 4 and GenerateState(args).retries == 3
    engine, [result] = _run(_serve_and_post(_args(tiny_qwen3, rollout_request_retries=1), [503, 503, 503]))
    assert isinstance(result, EngineUnavailableError) and "after 2 attempts" in str(result) and engine.calls == 2


def test_fault_tolerance_keeps_retrying_through_the_health_check_window(tiny_qwen3, plugin):
    args = _args(tiny_qwen3, rollout_request_retries=1, use_fault_tolerance=True)
    window = retry_window_s(args)
    assert window == args.rollout_health_check_interval + args.rollout_health_check_timeout + 10.0
    start = time.monotonic()
    engine, [result] = _run(_serve_and_post(args, [503] * 4))
    assert result["token_ids"] == [1] and engine.calls == 5  # 1 retry allowed, yet retried until it worked
    assert time.monotonic() - start < window


def test_in_flight_peak_is_counted(tiny_qwen3, plugin):
    args = _args(tiny_qwen3)
    engine, results = _run(_serve_and_post(args, [], n_requests=40))
    assert all(r["token_ids"] == [1] for r in results)
    state = GenerateState(args)
    assert state.in_flight == 0 and state.max_in_flight == 40 == engine.peak


def _group(n=4):
    return [Sample(group_index=0, index=i, tokens=[1, 2], status=Sample.Status.PENDING) for i in range(n)]


def test_a_fresh_group_is_one_request_with_each_samples_own_seed(tiny_qwen3, plugin):
    """vime's generate sends a group of fresh samples of one prompt as one request (n = group size): the engine
    gives sequence k the seed + k, which is sample k's own seed. Anything else goes sample by sample."""
    from vime.rollout.vllm_rollout import sample_seed

    async def rollout(group):
        engine = FakeEngine([])
        args = _args(tiny_qwen3, rm_type="random", rollout_seed=7, mask_offpolicy_in_partial_rollout=False)
        rollout_context().router_url = f"http://127.0.0.1:{await engine.start()}"
        try:
            return engine, args, await generate_and_rm_group(args, group, {"max_tokens": 4})
        finally:
            await engine.runner.cleanup()

    group = [Sample(group_index=3, index=12 + k, tokens=[1, 2], status=Sample.Status.PENDING) for k in range(4)]
    engine, args, out = _run(rollout(group))
    assert engine.calls == 1 and engine.payloads[0]["sampling_params"]["n"] == 4
    assert [sample_seed(args, group[0]) + k for k in range(4)] == [sample_seed(args, s) for s in group]
    assert engine.payloads[0]["sampling_params"]["seed"] == sample_seed(args, group[0])
    assert engine.payloads[0]["sampling_params"]["detokenize"] is False  # vime decodes the tokens itself
    assert [s.response_tokens for s in out] == [[1], [2], [3], [4]]  # choice k went to sample k
    assert all(s.status == Sample.Status.TRUNCATED and s.reward is not None for s in out)
    assert GenerateState(args).max_in_flight == 4  # in flight counts sequences, not requests

    GenerateState.reset()
    partial = [Sample(group_index=3, index=12 + k, tokens=[1, 2], status=Sample.Status.PENDING) for k in range(4)]
    partial[2].status, partial[2].tokens, partial[2].response_length = Sample.Status.ABORTED, [1, 2, 9], 1
    partial[2].loss_mask, partial[2].rollout_log_probs = [1], [-1.0]
    engine, args, out = _run(rollout(partial))  # a continued (partial-rollout) sample: one request per sample
    assert engine.calls == 4 and all("n" not in p["sampling_params"] for p in engine.payloads)
    assert sorted(p["sampling_params"]["seed"] for p in engine.payloads) == [sample_seed(args, s) for s in partial]


def test_blocking_sync_reward_times_out_per_sample_without_stalling_the_others(tiny_qwen3, plugin):
    args = _args(tiny_qwen3, custom_generate_function_path="failure_plugin.generate",
                 custom_rm_path="failure_plugin.blocking_reward", rm_timeout=0.5)
    start = time.monotonic()
    out = _run(generate_and_rm_group(args, _group(), {"max_tokens": 4}))
    assert time.monotonic() - start < 1.5  # the two sleeping rewards ran in threads, bounded by --rm-timeout
    assert [s.status for s in out] == [Sample.Status.COMPLETED, Sample.Status.FAILED] * 2
    assert [s.reward for s in out[::2]] == [1.0, 1.0]
    failure = out[1].metadata["failure"]
    assert failure["stage"] == "reward" and failure["reason"] == "timeout" and "--rm-timeout 0.5" in failure["error"]
    assert out[1].loss_mask == [0] and out[0].loss_mask == [1]


def test_wrong_reward_type_names_the_function_and_the_value(tiny_qwen3, plugin):
    args = _args(tiny_qwen3, custom_generate_function_path="failure_plugin.generate",
                 custom_rm_path="failure_plugin.none_reward")
    out = _run(generate_and_rm_group(args, _group(2), {"max_tokens": 4}))
    failure = out[0].metadata["failure"]
    assert failure["reason"] == "bad_return_type"
    assert failure["error"] == "--custom-rm-path failure_plugin.none_reward returned NoneType (None), expected a " \
                               "float or a dict"


def test_failure_metrics_by_reason_and_counters():
    def failed(stage, reason):
        return Sample(status=Sample.Status.FAILED, metadata={"failure": {"stage": stage, "reason": reason}})

    samples = [failed("reward", "timeout"), failed("reward", "timeout"), failed("generate", "engine_rejected"),
               Sample(status=Sample.Status.COMPLETED, reward=1.0, response_length=3)]
    args = SimpleNamespace(reward_key=None)
    reset_rollout_context()  # the counters live in this process's rollout context
    record_counters({"data/skipped_rows": 3.0})
    add_counter("rollout/engine_restarts")
    m = rollout_metrics(samples, args)
    assert m["rollout/failed_samples"] == 3 and m["rollout/failed/reward_timeout"] == 2
    assert m["rollout/failed/generate_engine_rejected"] == 1 and m["rollout/reward_mean"] == 1.0
    assert m["data/skipped_rows"] == 3 and m["rollout/engine_restarts"] == 1
    add_counter("rollout/engine_restarts")
    m = rollout_metrics(samples, args)
    assert "data/skipped_rows" not in m and m["rollout/engine_restarts"] == 2  # once-only vs running total
    assert "rollout/engine_restarts" not in rollout_metrics(samples, args, prefix="eval/x")


def test_filter_returning_the_wrong_type_is_a_clear_error(tiny_qwen3, plugin):
    from vime.data.data_source import RolloutDataSource
    from vime.rollout.vllm_rollout import generate_rollout_async

    args = _args(tiny_qwen3, custom_generate_function_path="failure_plugin.generate", rm_type="random",
                 dynamic_sampling_filter_path="failure_plugin.bool_filter", rollout_batch_size=1,
                 over_sampling_batch_size=1, max_dynamic_sampling_rounds=2, rollout_temperature=1.0,
                 rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=4, rollout_stop=None,
                 rollout_stop_token_ids=None, rollout_engine_urls=[], partial_rollout=False, seed=0)
    source = RolloutDataSource([Sample(prompt="p", tokens=[1, 2], label="1")], 2, seed=0, shuffle=False)
    with pytest.raises(TypeError, match="--dynamic-sampling-filter-path failure_plugin.bool_filter returned bool "
                                        r"\(True\), expected a DynamicFilterOutput"):
        _run(generate_rollout_async(args, 0, source))


def test_the_engine_detokenizes_only_for_stop_strings():
    from vime.engine.control.generate_request import tokens_only

    assert tokens_only({"sampling_params": {"max_tokens": 4}})["sampling_params"]["detokenize"] is False
    assert "detokenize" not in tokens_only({"sampling_params": {"stop": ["\n"]}})["sampling_params"]
    assert tokens_only({"sampling_params": {"detokenize": True}})["sampling_params"]["detokenize"] is True


def test_remax_adds_one_greedy_request_per_group_and_carries_its_reward(tiny_qwen3, plugin):
    """--advantage-estimator remax: beside the group's request, one temperature-0 request for the same prompt
    (n = 1), scored by the run's reward; every sample of the group carries that reward in its metadata."""
    from vime.rollout.rm_hub.random_rm import random_rm

    async def rollout(group):
        engine = FakeEngine([])
        args = _args(tiny_qwen3, rm_type="random", rollout_seed=7, mask_offpolicy_in_partial_rollout=False,
                     advantage_estimator="remax", seed=3)
        rollout_context().router_url = f"http://127.0.0.1:{await engine.start()}"
        try:
            return engine, args, await generate_and_rm_group(args, group, {"max_tokens": 4, "temperature": 1.0})
        finally:
            await engine.runner.cleanup()

    group = [Sample(group_index=3, index=12 + k, tokens=[1, 2], status=Sample.Status.PENDING) for k in range(4)]
    engine, args, out = _run(rollout(group))
    assert engine.calls == 2
    greedy = [p for p in engine.payloads if p["sampling_params"]["temperature"] == 0.0]
    assert len(greedy) == 1 and "n" not in greedy[0]["sampling_params"] and greedy[0]["token_ids"] == [1, 2]
    expected = random_rm(args, Sample(index=12))  # the greedy sample keeps the group's first index
    assert [s.metadata["remax_greedy_reward"] for s in out] == [expected] * 4
    assert [s.response_tokens for s in out] == [[1], [2], [3], [4]]  # the group's own samples are untouched
