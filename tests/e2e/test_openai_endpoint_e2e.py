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
from vime.utils.auth import control_headers, serving_headers

pytestmark = pytest.mark.e2e
SEED = 1234


def _post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json", **serving_headers()})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _served(engine_url: str) -> float:
    """Requests this engine finished (vLLM's Prometheus counter)."""
    with urllib.request.urlopen(urllib.request.Request(engine_url + "/metrics", headers=control_headers()),
                                timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@pytest.fixture(scope="module")
def stack(tiny_qwen3, tmp_path_factory):
    from transformers import AutoTokenizer

    from vime.backends.vllm_utils.arguments import router_args_from
    from vime.backends.vllm_utils.engine import VLLMEngine
    from vime.backends.vllm_utils.router import Router
    from vime.arguments import parse_args
    from vime.utils.misc import find_free_port

    assert not stack_pids(), "engine or router processes are already running"
    log_dir = str(tmp_path_factory.mktemp("openai_e2e"))
    args = parse_args(["--hf-checkpoint", str(tiny_qwen3), "--rollout-num-gpus", "2", "--router-policy",
                       "consistent_hash", "--vllm-enforce-eager", "--vllm-dtype", "float32",
                       "--vllm-max-model-len", "256"], validate=False)
    engines = [VLLMEngine(args, rank, log_dir) for rank in range(2)]
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
        router = Router(router_args_from(args, "127.0.0.1", find_free_port(), urls), log_dir)
        router_url = router.start()
        server = OpenAIServer(router_url, AutoTokenizer.from_pretrained(tiny_qwen3)).start()
        yield server, urls
    finally:
        if server is not None:
            server.stop()
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
        assert not stack_pids(), "engine or router processes outlived the test"


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
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], stream=True)
    with pytest.raises(openai.BadRequestError):  # longer than --vllm-max-model-len 256: the engine says no
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "one two " * 300}])
    assert server.session(conv) is None  # failed calls record nothing
    guessed = openai.OpenAI(base_url=server.base_url, api_key="conv-err", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        guessed.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
