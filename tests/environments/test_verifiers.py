"""verifiers environments through the bridge: vime starts the real bridge program in the verifiers venv, which
loads the real environment modules and runs their episodes with verifiers' own harness, interception server and
MCP tool server, relaying every model call to vime's real OpenAI-compatible endpoint. Only the engine is scripted
here (a fake token-in/token-out router behind the endpoint); tests/e2e/test_verifiers_e2e.py runs the real stack.
Also the error paths: no verifiers venv, a module that is no v1 taskset (or a pre-0.4 one), a reward function that
raises, a bridge that dies."""

from __future__ import annotations

import asyncio
import json
import os
import time
from types import SimpleNamespace

import pytest
from aiohttp import web

from tests.helpers.stand_in_router import StandInRouter
from vime.environments.base import EnvironmentSpec
from vime.environments.verifiers_env import VerifiersEnvironment, default_name
from vime.environments.verifiers_process import DEFAULT_PYTHON, BridgeError, verifiers_python
from vime.rollout.context import reset_rollout_context, rollout_context

needs_venv = pytest.mark.skipif(not os.access(DEFAULT_PYTHON, os.X_OK),
                                reason="no .venv-verifiers (bash scripts/install.sh makes it)")
LOOKUP_ARGS = {"agent": {"sampling": {"tool_choice": "required"}, "max_turns": 2}}


class ScriptedRouter(StandInRouter):
    """/inference/v1/generate answering with the token ids of `reply(body)` (a text), log-probs -0.5 each."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.requests = tokenizer, reply, []
        super().__init__()

    async def _generate(self, request):
        body = await request.json()
        self.requests.append(body)
        ids = self.tokenizer(self.reply(body), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return web.json_response({"choices": [{"token_ids": ids, "finish_reason": "stop", "weight_versions": ["3"],
                                               "logprobs": {"content": [{"logprob": -0.5}] * len(ids)}}]})


def reply(body) -> str:
    """A forced call looks up ada; a free answer repeats the fact, or says 4."""
    if "structured_outputs" in body["sampling_params"]:
        return json.dumps({"name": "facts_lookup", "arguments": {"name": "ada"}})
    return "4"


def _args(tmp_path, model=None, router_url=None, **over):
    if router_url:
        reset_rollout_context(router_url=router_url)  # what the rollout manager sets up in its process
    return SimpleNamespace(hf_checkpoint=str(model), router_policy="consistent_hash", rollout_max_response_len=24,
                           rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1,
                           apply_chat_template=True, apply_chat_template_kwargs=None, rollout_request_timeout=30,
                           rollout_request_retries=0, environment_eval_size=2, output_dir=str(tmp_path),
                           verifiers_python=None, agent_timeout=120.0, **over)


def _env(target, tmp_path, config=None, **args):
    return VerifiersEnvironment(EnvironmentSpec("verifiers", target, 1.0, dict(config or {})), _args(tmp_path, **args))


def test_missing_venv_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match=r"^--environment verifiers:\.\.\. runs verifiers 0\.4\.0 in its own venv .*"
                                         r"scripts/install\.sh creates it") as e:
        verifiers_python(str(tmp_path / "nope" / "python"))
    assert "\n" not in str(e.value)
    assert default_name("owner/my-env@0.2") == "my_env" and default_name("tests.environments.vf_lookup") == "vf_lookup"


@needs_venv
def test_a_module_that_is_no_v1_taskset_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "legacy_env.py").write_text("import verifiers\n\ndef load_environment(**kwargs):\n"
                                            "    return verifiers.SingleTurnEnv(dataset=None)\n")
    (tmp_path / "empty_env.py").write_text("X = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    envs = [_env(name, tmp_path) for name in ("legacy_env", "empty_env")]  # started side by side
    try:
        with pytest.raises(ValueError, match="has load_environment\\(\\) but exports no verifiers.v1 Taskset: .*"
                                             "pre-0.4 API .*SingleTurnEnv"):
            envs[0].tasks()
        with pytest.raises(ValueError, match="exports no verifiers.v1 Taskset subclass in __all__ \\(and has no "
                                             "load_environment\\(\\) either\\)"):
            envs[1].tasks()
    finally:
        for env in envs:
            env.close()
    assert all(env.bridge.proc.poll() is not None for env in envs)


@pytest.fixture(scope="module")
def stack(tiny_qwen3, tmp_path_factory):
    """The endpoint over a scripted router, and bridges for the four test environments (started together)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    router = ScriptedRouter(tokenizer, reply)
    tmp = tmp_path_factory.mktemp("verifiers")
    args = _args(tmp, tiny_qwen3, router.url)  # a fresh rollout context: the endpoint will be its own
    envs = {"arith": _env("tests.environments.vf_arithmetic", tmp, {"taskset": {"num_tasks": 6}, "size": 3}),
            "lookup": _env("tests.environments.vf_lookup", tmp, LOOKUP_ARGS),
            "broken": _env("tests.environments.vf_broken", tmp),
            "environ": _env("tests.environments.vf_environ", tmp, LOOKUP_ARGS)}
    yield SimpleNamespace(args=args, tokenizer=tokenizer, router=router, envs=envs)
    for env in envs.values():
        env.close()
    rollout_context().close()  # the endpoint
    router.stop()


def _run(stack, env, prompt):
    params = {"max_tokens": 24, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    sample = asyncio.run(env.generate(stack.args, prompt, params))
    return sample, asyncio.run(env.score(stack.args, sample))


def _template_ids(tokenizer, messages, tools=None, generation=True):
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@needs_venv
def test_single_turn_episode_tokens_and_per_function_rewards(stack):
    env, tokenizer = stack.envs["arith"], stack.tokenizer
    train, evals = env.train_prompts(tokenizer, stack.args), env.eval_prompts(tokenizer, stack.args, 2)
    assert [p.metadata["verifiers"]["task"] for p in train] == [0, 1, 2]
    assert [p.metadata["verifiers"]["task"] for p in evals] == [3, 4]  # the tasks after the training ones
    assert train[2].prompt == "What is 2 + 2?" and train[2].label == "4"
    assert env.reward_weights == {"exact_match": 1.0, "has_digit": 0.5, "brevity": 0.1}
    sample, reward = _run(stack, env, train[2])
    # the endpoint's record: the chat template's prompt, the engine's tokens trained with their log-probs
    prompt_ids = _template_ids(tokenizer, [{"role": "user", "content": "What is 2 + 2?"}])
    answer = tokenizer("4", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert sample.tokens == prompt_ids + answer and sample.prompt_length == len(prompt_ids)
    assert sample.loss_mask == [1] * len(answer) and sample.rollout_log_probs == [-0.5] * len(answer)
    assert sample.metadata["agent_role"] == "main" and sample.metadata["environment"] == "vf_arithmetic"
    assert reward == 1.55  # exact_match 1 x 1.0 + has_digit 1 x 0.5 + brevity 1 / (1 + 1) x 0.1
    assert sample.metadata["reward_functions"] == {"exact_match": 1.0, "has_digit": 1.0, "brevity": 0.5,
                                                   "reply_chars": 1.0}
    assert sample.metadata["reward_weights"] == {"exact_match": 1.0, "has_digit": 0.5, "brevity": 0.1,
                                                 "reply_chars": 0.0}


@needs_venv
def test_tool_episode_masks_the_tool_result(stack):
    """A forced call to the taskset's MCP tool (served by verifiers' own tool server process), its result back as
    a tool turn (context, masked), a second forced call, then verifiers' max_turns ends the episode."""
    env, tokenizer = stack.envs["lookup"], stack.tokenizer
    prompt = env.train_prompts(tokenizer, stack.args)[0]
    before = len(stack.router.requests)
    sample, reward = _run(stack, env, prompt)
    requests = stack.router.requests[before:]
    assert len(requests) == 2 and all("structured_outputs" in r["sampling_params"] for r in requests)
    turns = sample.metadata["agent_turns"]
    assert len(turns) == 2
    call = tokenizer(reply(requests[0]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert requests[0]["token_ids"] == sample.tokens[:sample.prompt_length]
    assert requests[1]["token_ids"] == sample.tokens[:turns[1]["prompt_tokens"]]
    response = sample.tokens[sample.prompt_length:]
    assert response[:len(call)] == call and response[-len(call):] == call
    tool_turn = tokenizer.decode(sample.tokens[sample.prompt_length + len(call):turns[1]["prompt_tokens"]])
    assert tool_turn == "\n<|im_start|>tool\nfirst programmer<|im_end|>\n<|im_start|>assistant\n"
    assert sample.loss_mask == [1] * len(call) + [0] * (len(response) - 2 * len(call)) + [1] * len(call)
    assert "facts_lookup" in tokenizer.decode(sample.tokens[:sample.prompt_length])  # the tools are in the prompt
    assert sample.metadata["reward_functions"] == {"used_tool": 1.0, "answered": 0.0} and reward == 0.5


@needs_venv
def test_programs_verifiers_launches_never_see_the_relay_key(stack):
    """The relay key opens the bridge's episodes at vime's endpoint; a program verifiers launches while an episode
    runs (here the episode's own tool server; in general the harness, which runs the policy's commands) must not
    inherit it. The tool reports every relay-key-like value in its environment."""
    env, tokenizer = stack.envs["environ"], stack.tokenizer
    sample, reward = _run(stack, env, env.train_prompts(tokenizer, stack.args)[0])
    assert reward == 1.0  # the tool answered: its server ran during the episode
    tool_turn = tokenizer.decode(sample.tokens).split("<|im_start|>tool\n", 1)[1].split("<|im_end|>", 1)[0]
    assert env.relay_key and env.relay_key not in tool_turn, tool_turn


@needs_venv
def test_reward_function_that_raises_fails_only_its_sample(stack):
    env = stack.envs["broken"]
    prompts = env.train_prompts(stack.tokenizer, stack.args)  # 4 tasks, 2 of them eval
    assert len(prompts) == 2
    ok, reward = _run(stack, env, prompts[0])
    assert reward == 1.0
    params = {"max_tokens": 24}
    sample = asyncio.run(env.generate(stack.args, prompts[1], params))
    with pytest.raises(RuntimeError, match="vf_broken, task 1: .*task 1 cannot be scored"):
        asyncio.run(env.score(stack.args, sample))


@needs_venv
def test_a_dead_bridge_fails_pending_and_new_requests(tmp_path):
    env = _env("tests.environments.vf_broken", tmp_path)
    try:  # killed while it still loads: a request already sent fails at once, as does any after
        rid, future = env.bridge.request({"op": "episode", "task": 0, "session": "x" * 32,
                                          "base_url": "http://127.0.0.1:9/v1", "timeout": 60})
        os.killpg(env.bridge.proc.pid, 9)
        started = time.monotonic()
        with pytest.raises(BridgeError, match="exited"):
            future.result(timeout=30)
        assert time.monotonic() - started < 10
        _, late = env.bridge.request({"op": "episode", "task": 0})
        with pytest.raises(BridgeError, match="not running"):
            late.result(timeout=5)
    finally:
        env.close()


def test_flags_refuse_a_missing_venv_before_anything_starts(tiny_qwen3, tmp_path, capsys):
    from vime.arguments import parse_args
    from vime.environments.hooks import GENERATE_PATH, REWARD_PATH

    argv = ["--hf-checkpoint", str(tiny_qwen3), "--environment", "verifiers:tests.environments.vf_arithmetic"]
    with pytest.raises(SystemExit):
        parse_args(argv + ["--verifiers-python", str(tmp_path / "python")])
    assert "runs verifiers 0.4.0 in its own venv" in capsys.readouterr().err
    if os.access(DEFAULT_PYTHON, os.X_OK):
        args = parse_args(argv)  # the environment's own loop and reward functions
        assert (args.custom_generate_function_path, args.custom_rm_path) == (GENERATE_PATH, REWARD_PATH)
