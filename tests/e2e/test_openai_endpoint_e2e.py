"""The OpenAI-compatible endpoint on the real stack: 2 vLLM engines behind vllm-router (consistent_hash), driven
by the real `openai` client. The recorded tokens and log-probs must be exactly what the engine produces for
those prompts, the loss mask must cover exactly the sampled tokens, and a session must stay on one engine."""

from __future__ import annotations

import json
import threading
import urllib.request

import openai
import pytest

from tests.e2e.processes import stack_pids
from vime.agents.openai_server import OpenAIServer
from vime.utils.auth import RunToken

pytestmark = pytest.mark.e2e
SEED = 1234
TOKEN = RunToken.new()  # the engines', which this test process sends as a run's rollout manager does


def _post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json", **TOKEN.serving_headers()})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _served(engine_url: str) -> float:
    """Requests this engine finished (vLLM's Prometheus counter)."""
    with urllib.request.urlopen(urllib.request.Request(engine_url + "/metrics", headers=TOKEN.control_headers()),
                                timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@pytest.fixture(scope="module")
def stack(tiny_qwen3, tmp_path_factory):
    from transformers import AutoTokenizer

    from vime.engine.control.arguments import router_args_from
    from vime.engine.control.engine import VLLMEngine
    from vime.engine.control.router import Router
    from vime.arguments import parse_args
    from vime.utils.misc import find_free_port

    assert not stack_pids(), "engine or router processes are already running"
    log_dir = str(tmp_path_factory.mktemp("openai_e2e"))
    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), "--rollout-num-gpus", "2", "--router-policy",
                       "consistent_hash", "--vllm-enforce-eager", "--vllm-dtype", "float32",
                       "--vllm-max-model-len", "512",
                       # forced tool calls (structured outputs) in compact JSON: an untrained model otherwise
                       # spends its tokens on the whitespace JSON allows
                       "--vllm-structured-outputs-config",
                       '{"backend": "xgrammar", "disable_any_whitespace": true}'], validate=False)
    engines = [VLLMEngine(args, rank, log_dir, TOKEN) for rank in range(2)]
    router = server = None
    try:
        errors = []

        def start(engine):
            try:
                engine.start()
            except Exception as e:  # reported below, after both starts returned
                errors.append(e)

        threads = [threading.Thread(target=start, args=(e,)) for e in engines]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors, errors
        urls = [e.url for e in engines]
        router = Router(router_args_from(args, "127.0.0.1", find_free_port(), urls), log_dir, TOKEN)
        router_url = router.start()
        server = OpenAIServer(router_url, AutoTokenizer.from_pretrained(tiny_qwen3), TOKEN).start()
        yield server, urls
    finally:
        if server is not None:
            server.stop()
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
        assert not stack_pids(), "engine or router processes outlived the test"


def _regenerate(engine: str, prompt: list[int], max_tokens: int, **extra) -> list[dict]:
    """The engine's answers to `prompt` asked directly, with the endpoint's seeded sampling."""
    return _post(engine + "/inference/v1/generate", {
        "model": "policy", "token_ids": prompt,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "seed": SEED, "logprobs": 0,
                            "skip_special_tokens": False, **extra}})["choices"]


def _assert_engine_made(engine: str, trajectory, turn: int, choice: dict) -> None:
    """Turn `turn` of `trajectory` holds exactly the engine's tokens and log-probs for that turn's prompt."""
    start = trajectory.turns[turn]["prompt_tokens"]
    n = trajectory.turns[turn]["completion_tokens"]
    assert trajectory.tokens[start:start + n] == choice["token_ids"]
    assert trajectory.loss_mask[start:start + n] == [1] * n and not any(trajectory.loss_mask[:trajectory.prompt_length])
    assert trajectory.log_probs[start:start + n] == pytest.approx(
        [c["logprob"] for c in choice["logprobs"]["content"]], abs=1e-5)


def _chat(client, messages, max_tokens=12):
    return client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens,
                                          temperature=1.0, top_p=1.0, seed=SEED)


def test_multi_turn_chat_records_the_engines_tokens(stack):
    server, engine_urls = stack
    conv1, conv2 = server.open_episode(), server.open_episode()  # each agent's key: its episode's token
    client = openai.OpenAI(base_url=server.base_url, api_key=conv1, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["policy"]

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 3?"}]
    served_before = [_served(u) for u in engine_urls]
    replies = []
    for question in ("Times 2?", "And minus 1?"):
        reply = _chat(client, messages)
        replies.append(reply)
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage.completion_tokens > 0
        messages = messages + [reply.choices[0].message.model_dump(), {"role": "user", "content": question}]
    replies.append(_chat(client, messages))
    served = [_served(u) - b for u, b in zip(engine_urls, served_before)]
    assert sorted(served) == [0, 3], f"the session's 3 calls were spread over the engines: {served}"
    engine = engine_urls[served.index(3)]

    session = server.session(conv1)
    (traj,) = session.trajectories  # every call extended the previous one: one token sequence
    assert len(traj.turns) == 3
    assert len(traj.tokens) == len(traj.loss_mask) == len(traj.log_probs)
    first_prompt = server.template.prompt_ids(messages[:2])
    assert traj.tokens[: traj.prompt_length] == first_prompt
    assert all(m == 0 for m in traj.loss_mask[: traj.prompt_length])

    # Turn by turn: the prompt the engine saw is the recorded prefix; regenerating from it with the same seed
    # on the same engine gives exactly the recorded tokens and log-probs.
    position = 0
    for turn, reply in zip(traj.turns, replies):
        prompt_len, n = turn["prompt_tokens"], turn["completion_tokens"]
        assert n == reply.usage.completion_tokens and prompt_len == reply.usage.prompt_tokens
        assert all(m == 0 for m in traj.loss_mask[position:prompt_len])  # template glue, user turns
        assert traj.loss_mask[prompt_len:prompt_len + n] == [1] * n
        again = _post(engine + "/inference/v1/generate", {
            "model": "policy", "token_ids": traj.tokens[:prompt_len],
            "sampling_params": {"max_tokens": 12, "temperature": 1.0, "top_p": 1.0, "seed": SEED, "logprobs": 0,
                                "skip_special_tokens": False}})["choices"][0]
        assert traj.tokens[prompt_len:prompt_len + n] == again["token_ids"]
        assert traj.log_probs[prompt_len:prompt_len + n] == pytest.approx(
            [c["logprob"] for c in again["logprobs"]["content"]], abs=1e-5)
        position = prompt_len + n
    assert position == len(traj.tokens)

    # Teacher-forced re-scoring of the whole recorded sequence: the log-probs are aligned with their tokens.
    scored = _post(engine + "/v1/completions", {"model": "policy", "prompt": traj.tokens, "max_tokens": 1,
                                                "prompt_logprobs": 0, "temperature": 1.0})
    prompt_logprobs = scored["choices"][0]["prompt_logprobs"]
    for i, (token, mask) in enumerate(zip(traj.tokens, traj.loss_mask)):
        if mask:
            assert prompt_logprobs[i][str(token)]["logprob"] == pytest.approx(traj.log_probs[i], abs=1e-4)

    # The second session gets its own record; the first is untouched.
    other = openai.OpenAI(base_url=server.base_url, api_key=conv2, max_retries=0, timeout=120)
    _chat(other, [{"role": "user", "content": "hello"}])
    assert len(server.session(conv2).trajectories[0].turns) == 1
    assert len(server.session(conv1).trajectories[0].turns) == 3
    closed = server.close_episode(conv2)
    assert list(closed) == [conv2]
    with pytest.raises(openai.AuthenticationError):  # a closed episode's token, like a guessed one, is refused
        _chat(other, [{"role": "user", "content": "hello"}])


def test_errors_are_openai_shaped(stack):
    server, _ = stack
    conv = server.open_episode()
    client = openai.OpenAI(base_url=server.base_url, api_key=conv, max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], n=100)
    with pytest.raises(openai.BadRequestError, match="not among the request's tools"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], tools=WEATHER,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError):  # longer than --vllm-max-model-len 512: the engine says no
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "one two " * 300}])
    assert server.session(conv) is None  # failed calls record nothing
    guessed = openai.OpenAI(base_url=server.base_url, api_key="conv-err", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        guessed.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])


WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                      "required": ["city"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": WEATHER_PARAMETERS}}]


def _serving_engine(engine_urls, before):
    served = [_served(u) - b for u, b in zip(engine_urls, before)]
    assert sorted(served)[0] == 0, f"a session's calls were spread over the engines: {served}"
    return engine_urls[served.index(max(served))]


def test_tools_streaming_n_and_logprobs_with_the_openai_client(stack):
    """Chat completions as harnesses send them: a required tool call comes back as structured tool_calls and
    its result goes back as a tool message, one trajectory; stream=True gives the seeded answer's exact tokens;
    n=4 gives four trained trajectories; logprobs/top_logprobs are the recorded ones. Every recorded turn is
    the engine's own tokens and log-probs."""
    server, engine_urls = stack
    token = server.open_episode()
    client = openai.OpenAI(base_url=server.base_url, api_key=f"{token}/tools", max_retries=0, timeout=120)
    before = [_served(u) for u in engine_urls]

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=WEATHER, tool_choice="required",
                                           max_tokens=64, temperature=1.0, seed=SEED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    messages += [choice.message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model="policy", messages=messages, tools=WEATHER, max_tokens=12,
                                            temperature=1.0, seed=SEED)
    session = server.session(f"{token}/tools")
    (trajectory,) = session.trajectories  # the tool result extended the recorded sequence
    assert [t["completion_tokens"] for t in trajectory.turns] == [reply.usage.completion_tokens,
                                                                   answer.usage.completion_tokens]
    tool_turn = server.tokenizer.decode(trajectory.tokens[:trajectory.turns[1]["prompt_tokens"]])
    assert "# Tools" in tool_turn and "<|im_start|>tool\nsunny, 21 C<|im_end|>" in tool_turn
    engine = _serving_engine(engine_urls, before)
    from vime.agents.tool_parsing import forced_call_schema

    forced = {"structured_outputs": {"json": forced_call_schema(WEATHER)}}
    _assert_engine_made(engine, trajectory, 0, _regenerate(engine, trajectory.tokens[:trajectory.turns[0][
        "prompt_tokens"]], 64, **forced)[0])
    _assert_engine_made(engine, trajectory, 1, _regenerate(engine, trajectory.tokens[:trajectory.turns[1][
        "prompt_tokens"]], 12)[0])

    # The same seeded request streamed: the same tokens (a second trajectory: the messages repeat, not extend).
    question = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(model="policy", messages=question, max_tokens=12, seed=SEED,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model="policy", messages=question, max_tokens=12, seed=SEED,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    first, second = session.trajectories[1:]
    assert first.tokens == second.tokens and first.log_probs == pytest.approx(second.log_probs, abs=1e-6)
    content = plain.choices[0].logprobs.content
    sampled = first.tokens[first.prompt_length:]
    assert len(content) == len(sampled)
    assert [c.logprob for c in content] == pytest.approx(first.log_probs[first.prompt_length:], abs=1e-6)
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6

    # n=4: four answers, four trained trajectories, each the engine's.
    four = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Count."}],
                                          max_tokens=8, seed=SEED, n=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    branches = session.trajectories[3:]
    assert len(branches) == 4 and four.usage.completion_tokens == sum(t.turns[0]["completion_tokens"]
                                                                      for t in branches)
    again = _regenerate(engine, branches[0].tokens[:branches[0].prompt_length], 8, n=4)
    for trajectory, engine_choice in zip(branches, again):
        _assert_engine_made(engine, trajectory, 0, engine_choice)
    samples = server.close_episode(token)[f"{token}/tools"]
    assert len(samples.trajectories) == 7


def test_anthropic_messages_and_responses_api_round_trips(stack):
    """The `anthropic` client against /v1/messages (a forced tool_use, its tool_result back, a streamed answer)
    and the `openai` client's Responses API (a function call, its output back by previous_response_id): each
    round trip is one trained trajectory whose turns are the engine's tokens."""
    import anthropic

    server, engine_urls = stack
    token = server.open_episode()
    root = server.base_url[: -len("/v1")]
    claude = anthropic.Anthropic(base_url=root, api_key=f"{token}/claude", max_retries=0, timeout=120)
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_PARAMETERS}]
    question = {"role": "user", "content": "What is the weather in Rome?"}
    message = claude.messages.create(model="policy", max_tokens=64, messages=[question], tools=tools,
                                     tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome")
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]}
    with claude.messages.stream(model="policy", max_tokens=12, tools=tools,
                                messages=[question, {"role": "assistant", "content": message.content},
                                          result]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert "".join(b.text for b in final.content if b.type == "text") == text
    (trajectory,) = server.session(f"{token}/claude").trajectories
    assert len(trajectory.turns) == 2 and final.usage.output_tokens == trajectory.turns[1]["completion_tokens"]
    assert "<|im_start|>tool\nrain<|im_end|>" in server.tokenizer.decode(trajectory.tokens)

    responder = openai.OpenAI(base_url=server.base_url, api_key=f"{token}/responses", max_retries=0, timeout=120)
    function_tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
                       "parameters": WEATHER_PARAMETERS, "strict": True}]
    first = responder.responses.create(model="policy", instructions="Use the tool.", input="Weather in Paris?",
                                       tools=function_tools, tool_choice="required", max_output_tokens=64)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    second = responder.responses.create(model="policy", instructions="Use the tool.", previous_response_id=first.id,
                                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                                "output": "sunny"}],
                                        tools=function_tools, max_output_tokens=12)
    assert second.status in ("completed", "incomplete")
    (trajectory,) = server.session(f"{token}/responses").trajectories
    assert len(trajectory.turns) == 2
    assert trajectory.turns[1]["completion_tokens"] == second.usage.output_tokens
    decoded = server.tokenizer.decode(trajectory.tokens)
    assert decoded.startswith("<|im_start|>system\nUse the tool.") and "<|im_start|>tool\nsunny" in decoded
    server.close_episode(token)
