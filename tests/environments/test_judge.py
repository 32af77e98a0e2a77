"""The judge client around its engines: the OpenAI-compatible request it sends (the run's serving key, the
judge's defaults), what it returns, the concurrency bound, a timeout as `JudgeTimeout`, and its metrics. A small
aiohttp server stands in for the judge's vLLM engine; the e2e test runs the real one."""

from __future__ import annotations

import argparse
import asyncio
import threading

import pytest
from aiohttp import web

from vime.environments.judge import JudgeGroup, JudgeTimeout, run_judge
from vime.rollout.context import reset_rollout_context
from vime.rollout.metrics import take_counters
from vime.utils.auth import RunToken


class _FakeJudge:
    def __init__(self, delay: float):
        self.delay, self.bodies, self.headers, self.in_flight, self.peak = delay, [], [], 0, 0

    async def chat(self, request):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.delay if "slow" not in body["messages"][0]["content"] else 5.0)
        self.in_flight -= 1
        return web.json_response({"choices": [{"message": {"content": "yes"}, "token_ids": [7, 8],
                                               "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}}],
                                  "prompt_token_ids": [1, 2, 3], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


def _serve(handler):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{port}", loop


def test_judge_calls_are_bounded_timed_and_counted():
    fake = _FakeJudge(delay=0.2)
    url, loop = _serve(fake.chat)
    reset_rollout_context()
    group = JudgeGroup.__new__(JudgeGroup)  # the client half: engines are the e2e test's
    group.args = argparse.Namespace(judge_concurrency=3, judge_timeout=1.0, judge_max_tokens=5, judge_temperature=0.0)
    group.engines, group.urls, group.semaphore, group._next, group._session = [], [url], None, 0, None
    group.token = RunToken.new()  # the run's, which its engines were started with
    reset_rollout_context(judge=group)
    assert run_judge() is group and group.base_url == f"{url}/v1" and group.api_key == group.token.serving_key()

    async def calls():
        replies = await asyncio.gather(*(group.chat([{"role": "user", "content": f"q{i}"}]) for i in range(7)))
        with pytest.raises(JudgeTimeout, match="--judge-timeout 1.0s"):
            await group.chat([{"role": "user", "content": "slow"}], temperature=0.5)
        await group._session.close()
        return replies

    replies = asyncio.run(calls())
    assert replies[0] == {"text": "yes", "token_ids": [7, 8], "prompt_token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2]}
    assert fake.peak == 3  # --judge-concurrency: the other calls waited
    assert all(h == f"Bearer {group.token.serving_key()}" for h in fake.headers)
    body = fake.bodies[0]
    assert body["max_tokens"] == 5 and body["temperature"] == 0.0 and body["return_token_ids"] and body["logprobs"]
    assert fake.bodies[-1]["temperature"] == 0.5
    counters = take_counters()
    assert counters["judge/calls"] == 8 and counters["judge/timeouts"] == 1 and "judge/errors" not in counters
    assert counters["judge/completion_tokens"] == 14 and counters["judge/time_s"] >= 1.0
    loop.call_soon_threadsafe(loop.stop)
    reset_rollout_context()


def test_judge_flags(tiny_qwen3, tmp_path, capsys):
    from vime.arguments import parse_args

    def parse(*extra):
        return parse_args(["--hf-checkpoint", str(tiny_qwen3), "--output-dir", str(tmp_path), "--rm-type", "math",
                           "--prompt-data", str(tiny_qwen3 / "config.json"), *extra], check_model=False)

    assert parse("--judge-checkpoint", str(tiny_qwen3)).judge_checkpoint == str(tiny_qwen3)
    for extra, message in [(("--judge-checkpoint", str(tmp_path)), "no config.json there"),
                           (("--judge-checkpoint", str(tiny_qwen3), "--judge-timeout", "0"), "--judge-timeout must"),
                           (("--judge-checkpoint", str(tiny_qwen3), "--judge-concurrency", "0"), "--judge-concurrency")]:
        with pytest.raises(SystemExit):
            parse(*extra)
        assert message in capsys.readouterr().err
