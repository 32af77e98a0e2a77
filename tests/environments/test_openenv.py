"""OpenEnv environments: vime starts the app's server (a real uvicorn process, behind a token of its own) and
stops it, or uses one running; an episode is driven turn by turn over a WebSocket session through vime's multi-turn
loop. The engine is scripted here (the rest is real); the e2e test runs it on the real stack. Also what another user
on the node gets: no session without the server's token, and no episode from a port they took first."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.unit.test_impersonation import impostor  # noqa: F401 - a fixture: uid 65534 holding a free port
from vime.data.sample import Sample
from vime.environments.mixture import load_environments
from vime.rollout.context import reset_rollout_context
from vime.rollout.vllm_rollout import GenerateState
from vime.utils.listeners import process_tree
from vime.utils.misc import find_free_port
from vime.utils.process import wait_until

pytest.importorskip("openenv.core.generic_client")
APP = "tests.environments.openenv_digits"


def _args(tiny_qwen3, tmp_path, environment=f"openenv:{APP}", config='{"size": 4}', weight=1.0):
    return argparse.Namespace(environment=[environment], environment_weights=[weight], environment_args=[config],
                              environment_eval_size=2, output_dir=str(tmp_path), hf_checkpoint=str(tiny_qwen3),
                              rollout_concurrency=8, custom_generate_function_path=None, apply_chat_template=True,
                              apply_chat_template_kwargs=None, agent_max_turns=3, agent_max_turn_tokens=None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture()
def running_server():
    """The URL of the digits app served by a plain uvicorn process of the test's own (no token): a server the
    user started, as `openenv:http://...` expects."""
    from vime.environments.openenv_env import _healthy

    port = find_free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", f"{APP}:app", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _healthy(url), 60, 0.3, alive=lambda: proc.poll() is None), "uvicorn did not start"
        yield url
    finally:
        proc.kill()
        proc.wait()


def test_episode_turn_by_turn_rewards_and_server_lifetime(tiny_qwen3, tmp_path, monkeypatch, running_server):
    from transformers import AutoTokenizer

    import vime.agents.multi_turn as multi_turn

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    answers = iter(["no idea", "7", "3", "3"])  # episode 1 (digit 7): miss then hit; episode 2 (digit 3): hit
    requests = []

    async def engine(args, token_ids, params, model=None):
        requests.append(list(token_ids))
        ids = tokenizer(next(answers), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return {"token_ids": ids, "logprobs": {"content": [{"logprob": -0.5}] * len(ids)}, "finish_reason": "stop"}

    monkeypatch.setattr(multi_turn, "post_generate", engine)
    reset_rollout_context()
    args = _args(tiny_qwen3, tmp_path, config='{"size": 7, "max_turns": 3}')
    env = load_environments(args)[0]
    pid = env.server.pid
    try:
        assert env.name == "openenv_digits" and _alive(pid)
        prompts = env.train_prompts(tokenizer, args)
        assert [p.metadata["openenv"]["seed"] for p in prompts] == list(range(7))
        assert [p.metadata["openenv"]["seed"] for p in env.eval_prompts(tokenizer, args, 2)] == [7, 8]
        sample = Sample(index=0, metadata={"environment": "openenv_digits", "openenv": {"seed": 7}})
        sample = asyncio.run(env.generate(args, sample, {"max_tokens": 64}))
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say the digit 7."}],
                                               add_generation_prompt=True, tokenize=False)
        assert sample.tokens[:sample.prompt_length] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert requests[0] == sample.tokens[:sample.prompt_length] and len(requests) == 2
        assert sample.metadata["openenv"] == {"seed": 7, "done": True, "rewards": [0.0, 1.0], "steps": 2}
        assert "No. Say the digit 7." in tokenizer.decode(sample.response_tokens)
        turns = sample.metadata["turns"]
        assert [t["role"] for t in turns] == ["assistant", "environment", "assistant"]
        env_turn = turns[1]
        assert sample.loss_mask[env_turn["start"]:env_turn["start"] + env_turn["length"]] == [0] * env_turn["length"]
        assert sum(sample.loss_mask) == turns[0]["length"] + turns[2]["length"]
        assert asyncio.run(env.score(args, sample)) == 1.0
        assert sample.metadata["reward_functions"] == {"episode_return": 1.0, "terminated": 1.0}

        # an environment object on a server already running (no process of its own)
        other = load_environments(_args(tiny_qwen3, tmp_path, environment=f"openenv:{running_server}",
                                        config='{"name": "running"}', weight=2.5))[0]
        assert other.server is None and other.name == "running" and other.weight == 2.5
        second = asyncio.run(other.generate(args, Sample(index=1, metadata={"environment": "running",
                                                                            "openenv": {"seed": 3}}),
                                            {"max_tokens": 64}))
        assert second.metadata["openenv"]["rewards"] == [1.0]

        # at --agent-max-turns the last model turn is still an action: stepped for its reward
        one = load_environments(_args(tiny_qwen3, tmp_path, environment=f"openenv:{running_server}",
                                      config='{"name": "one", "max_turns": 1}'))[0]
        answers = iter(["x"])
        last = asyncio.run(one.generate(args, Sample(index=3, metadata={"environment": "one",
                                                                        "openenv": {"seed": 3}}), {"max_tokens": 64}))
        assert last.metadata["stop"] == "max_turns" and [t["role"] for t in last.metadata["turns"]] == ["assistant"]
        assert last.metadata["openenv"] == {"seed": 3, "done": False, "rewards": [0.0], "steps": 1}

        # the environment's error fails the episode with the server's message (the hooks record it per sample)
        answers = iter(["raise"])
        with pytest.raises(RuntimeError, match="the environment failed"):
            asyncio.run(env.generate(args, Sample(index=2, metadata={"environment": "openenv_digits",
                                                                     "openenv": {"seed": 1}}), {"max_tokens": 64}))
    finally:
        env.close()
        GenerateState.reset()
    assert not _alive(pid)


def test_unservable_app_and_dead_url_are_clear_errors(tiny_qwen3, tmp_path):
    with pytest.raises(RuntimeError, match="did not become healthy"):
        load_environments(_args(tiny_qwen3, tmp_path, environment="openenv:no_such_module_xyz",
                                config='{"startup_timeout": 20}'))
    with pytest.raises(ValueError, match="no healthy OpenEnv server there"):
        load_environments(_args(tiny_qwen3, tmp_path, environment="openenv:http://127.0.0.1:9", config="{}"))
    with pytest.raises(ValueError, match="unknown keys bogus"):
        load_environments(_args(tiny_qwen3, tmp_path, config='{"bogus": 1}'))


def _status(url: str, method: str = "GET") -> int:
    request = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_server_vime_starts_answers_only_its_token(tiny_qwen3, tmp_path):
    """Without the server's token nobody opens a session or steps (another user has no way to it: it is in no
    argv or environment); the run's own episodes carry it; once the server has exited, nothing more goes to its
    port, which anyone could bind next."""
    from openenv.core.generic_client import GenericEnvClient

    env = load_environments(_args(tiny_qwen3, tmp_path))[0]
    try:
        for path, method in (("/health", "GET"), ("/reset", "POST"), ("/step", "POST"), ("/state", "GET")):
            assert _status(env.url + path, method) == 401, path

        async def session_without_token():
            client = GenericEnvClient(base_url=env.url, connect_timeout_s=10)
            try:
                await client.connect()
            finally:
                await client.close()

        with pytest.raises(ConnectionError, match="HTTP 403"):
            asyncio.run(session_without_token())
        token = env.server.headers["Authorization"].split()[1].encode()
        for pid in process_tree(env.server.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline, open(f"/proc/{pid}/environ", "rb") as environ:
                assert token not in cmdline.read() and token not in environ.read(), pid

        async def run_reset():  # what each episode does first, with the token
            client = env._client(10.0)
            try:
                await client.connect()
                return (await client.reset(seed=4)).observation
            finally:
                await client.close()

        assert asyncio.run(run_reset())["prompt"] == "Say the digit 4."
        for pid in process_tree(env.server.pid) - {env.server.pid}:  # the server dies; its watchdog then exits
            os.kill(pid, 9)
        assert wait_until(lambda: env.server.proc.poll() is not None, 30, 0.1)
        sample = Sample(index=0, metadata={"environment": env.name, "openenv": {"seed": 1}})
        with pytest.raises(RuntimeError, match="the server vime started exited"):
            asyncio.run(env.generate(_args(tiny_qwen3, tmp_path), sample, {"max_tokens": 8}))
    finally:
        env.close()


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to run the impostor as another user")
def test_a_port_another_user_took_first_gets_nothing(impostor, tmp_path, monkeypatch):  # noqa: F811
    """Another user binds the port chosen for the environment server before it does, and answers everything with
    200: the start fails naming the port and that user, and the impostor saw no request at all (no token, no
    episode, not even /health)."""
    from vime.environments import openenv_env

    port, received = impostor
    monkeypatch.setattr("vime.utils.misc.find_free_port", lambda *a: port)
    with pytest.raises(RuntimeError, match=f"port {port} is held by a process that vime did not start "
                                           r"\(uid 65534\); nothing was sent to it"):
        openenv_env.OpenEnvServer(APP, 60.0, tmp_path)
    assert received() == []
