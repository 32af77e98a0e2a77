"""The agent harness around the OpenAI endpoint: rewards, per-role samples and groups, forced sampling. The
episode test puts a fake token-in/token-out router behind the real endpoint and drives it with the real
`openai` client (the real engine path is tests/e2e/test_openai_endpoint_e2e.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import openai
import pytest
from aiohttp import web

from tests.helpers.stand_in_router import StandInRouter
from vime.agents import harness
from vime.agents.harness import agent_reward, assign_rewards, forced_sampling, split_role_groups
from vime.agents.openai_requests import call_seed, routing_key
from vime.data.sample import Sample
from vime.rollout.context import reset_rollout_context, rollout_context

FAKE_TOKENS = [40, 41, 42]


class FakeRouter(StandInRouter):
    """Answers /inference/v1/generate with FAKE_TOKENS and log-probs -0.5, -0.25, ...; remembers requests."""

    def __init__(self):
        self.requests: list[tuple[dict, str | None]] = []
        super().__init__()

    async def _generate(self, request):
        body = await request.json()
        self.requests.append((body, request.headers.get("X-Session-ID")))
        n = min(len(FAKE_TOKENS), body["sampling_params"]["max_tokens"])
        return web.json_response({"choices": [{
            "token_ids": FAKE_TOKENS[:n], "finish_reason": "length",
            "logprobs": {"content": [{"logprob": -0.5 / (i + 1)} for i in range(n)]}, "weight_versions": ["7"]}]})


def _args(model, router_url):
    reset_rollout_context(router_url=router_url)  # what the rollout manager sets up in its process
    return SimpleNamespace(hf_checkpoint=str(model), router_policy="consistent_hash", rollout_max_response_len=8,
                           rollout_temperature=0.7, rollout_top_p=1.0, rollout_top_k=-1,
                           apply_chat_template_kwargs=None, rollout_request_timeout=30, rollout_request_retries=0)


def test_episode_with_two_roles_becomes_per_role_samples(tiny_qwen3):
    router = FakeRouter()
    try:
        args = _args(tiny_qwen3, router.url)
        seen = {}

        def agent(base_url, session_id, sample):  # a sync agent with the sync client (runs in a thread)
            seen["session"] = session_id
            solver = openai.OpenAI(base_url=base_url, api_key=f"{session_id}/solver", max_retries=0)
            checker = openai.OpenAI(base_url=base_url, api_key=f"{session_id}/checker", max_retries=0)
            messages = [{"role": "user", "content": sample.prompt}]
            first = solver.chat.completions.create(model="policy", messages=messages, temperature=1.5)
            messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "sure?"}]
            solver.chat.completions.create(model="policy", messages=messages, max_tokens=2)
            checker.chat.completions.create(model="policy", messages=[{"role": "user", "content": "check"}])
            return {"solver": 1.0, "checker": 0.0}

        generate = harness.agent_generate(agent)
        prompt = Sample(group_index=3, index=12, prompt="Repeat the number 42.", label="42", metadata={"m": 1})
        params = {"max_tokens": 8, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "seed": 99}
        main = asyncio.run(generate(args, prompt, params))

        # the run's sampling is forced (the agent asked for 1.5), the seed varies per role and call
        temps = {body["sampling_params"]["temperature"] for body, _ in router.requests}
        assert temps == {0.7}
        seeds = [body["sampling_params"]["seed"] for body, _ in router.requests]
        assert len(set(seeds)) == 3
        token = seen["session"]
        assert len(token) == 32 and int(token, 16) >= 0  # 128 random bits, the agent's credential
        # one router affinity key per session, which is not the credential
        keys = [key for _, key in router.requests]
        assert keys == [routing_key(f"{token}/solver")] * 2 + [routing_key(f"{token}/checker")]
        assert token not in "".join(keys)
        assert router.requests[1][0]["sampling_params"]["max_tokens"] == 2  # a smaller request is honoured

        assert main.metadata["agent_role"] == "solver" and main.metadata["m"] == 1
        (checker,) = [Sample.from_dict(d) for d in main.metadata["agent_role_samples"]]
        assert checker.metadata["agent_role"] == "checker"
        assert [t["completion_tokens"] for t in main.metadata["agent_turns"]] == [3, 2]
        assert main.response_length == len(main.loss_mask) == len(main.rollout_log_probs)
        assert sum(main.loss_mask) == 5 and main.loss_mask[:3] == [1, 1, 1] and main.loss_mask[-2:] == [1, 1]
        assert main.rollout_log_probs[:3] == pytest.approx([-0.5, -0.25, -0.5 / 3])
        assert main.response_tokens[:3] == FAKE_TOKENS
        assert main.weight_versions == [7]
        assert agent_reward(None, main) == 1.0 and agent_reward(None, checker) == 0.0
        assert main.status == Sample.Status.TRUNCATED
        assert main.metadata["agent_session"] == f"{token}/solver"
        server = rollout_context().agent_server  # the run's endpoint, held by its rollout context
        assert server.episodes == {}  # closed episodes are handed over, not kept
        late = openai.OpenAI(base_url=server.base_url, api_key=f"{token}/solver", max_retries=0)
        with pytest.raises(openai.AuthenticationError):  # the episode is over: its token no longer works
            late.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}])
        assert server.episodes == {} and len(router.requests) == 3
    finally:
        rollout_context().close()
        assert rollout_context().agent_server is None
        router.stop()


def _episode(group_index, index, roles, rewards, status=Sample.Status.COMPLETED):
    samples = [Sample(group_index=group_index, index=index, tokens=[1, 2, 3], response_length=1, loss_mask=[1],
                      rollout_log_probs=[-0.1], status=status, metadata={"agent_role": r}) for r in roles]
    assign_rewards(samples, rewards)
    main = samples[0]
    main.reward = agent_reward(None, main)
    if samples[1:]:
        main.metadata["agent_role_samples"] = [s.to_dict() for s in samples[1:]]
    return main


def test_split_role_groups_gives_one_group_per_role():
    failed = Sample(group_index=0, index=2, tokens=[1, 2], status=Sample.Status.FAILED,
                    metadata={"failure": {"stage": "generate", "error": "x"}})
    group = [_episode(0, 0, ["solver", "checker"], {"solver": 1.0, "checker": 0.0}),
             _episode(0, 1, ["solver", "checker"], {"solver": 0.0, "checker": 1.0}), failed]
    out = split_role_groups([group])
    assert [[s.metadata["agent_role"] for s in g] for g in out] == [["solver"] * 3, ["checker"] * 3]
    assert [s.reward for s in out[0]] == [1.0, 0.0, None] and [s.reward for s in out[1]] == [0.0, 1.0, None]
    assert [s.index for s in out[1]] == [0, 1, 2]
    assert out[0][2].status == out[1][2].status == Sample.Status.FAILED
    assert out[1][2].response_length == 0 and out[1][2].tokens == [1, 2]
    assert all("agent_role_samples" not in s.metadata for g in out for s in g)
    single = [_episode(1, 4, ["main"], 0.5), _episode(1, 5, ["main"], 1.0)]
    assert split_role_groups([single]) == [single]


def test_rewards_and_sampling_rules():
    samples = [Sample(metadata={"agent_role": "a"}), Sample(metadata={"agent_role": "b"})]
    assign_rewards(samples, 0.5)
    assert [s.metadata["agent_reward"] for s in samples] == [0.5, 0.5]
    samples = [Sample(metadata={"agent_role": "a"})]
    assign_rewards(samples, {"acc": 1.0, "len": 3})  # not role names: one reward dict for every role
    assert samples[0].metadata["agent_reward"] == {"acc": 1.0, "len": 3}
    samples = [Sample(metadata={"agent_role": "a"})]
    assign_rewards(samples, "The answer is 4")
    assert samples[0].response == "The answer is 4" and "agent_reward" not in samples[0].metadata
    with pytest.raises(ValueError, match="no reward"):
        agent_reward(None, samples[0])
    with pytest.raises(TypeError):
        assign_rewards([Sample(metadata={"agent_role": "a"})], [1.0])

    params = {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "logprobs": 0}
    assert forced_sampling(SimpleNamespace(), params) == {"max_tokens": 8, "seed": 3, "temperature": 0.7,
                                                          "top_p": 0.9, "top_k": 5}
    assert forced_sampling(SimpleNamespace(agent_use_request_sampling=True), params) == {"max_tokens": 8, "seed": 3}
    assert call_seed(3, "e/a", 0) != call_seed(3, "e/b", 0) != call_seed(3, "e/b", 1)
    assert call_seed(3, "e/a", 0) == call_seed(3, "e/a", 0)
