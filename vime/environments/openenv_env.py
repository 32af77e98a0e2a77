"""`--environment openenv:<module or URL>`: an OpenEnv (openenv-core) environment, stepped turn by turn.

- `openenv:http://127.0.0.1:8000`: a server already running (bound to loopback or a private network: its
  WebSocket sessions run whatever the server does). vime sends it no credential and cannot tell whose it is: keep
  it where only you can reach it;
- `openenv:pkg.server.app` (or `pkg.server.app:app`): the module of an OpenEnv FastAPI app (`create_app(...)`);
  vime starts it as its own server process on a loopback port (uvicorn, `openenv_server`), waits for /health, and
  stops it when the run ends. That server answers only requests carrying its own random token
  (`openenv_server.RequireToken`; given on its standard input), and vime sends the token, and any episode, only once
  the port's listener is that process (`vime.utils.listeners.foreign_listener`): another user on the node can
  neither open sessions in it nor take its port and play the environment.

One episode is one sample: a WebSocket session (`GenericEnvClient`, one server-side environment per session),
`reset(seed=...)`, then vime's multi-turn loop (`vime.agents.multi_turn.generate`: exact token ids and log-probs,
model turns trained, environment turns masked): each model turn becomes the action `{action_key: text}`, the
step's observation text the next user turn, until the environment says `done` or --agent-max-turns model turns
(the last one stepped too, for its reward); a model turn cut by the token budget is not an action.
The reward is the episode's return, the sum of the rewards the steps gave (reported as the function
`episode_return`; `terminated` says whether the environment ended the episode, weight 0). A step that errors or
exceeds `step_timeout` fails the sample.

`--environment-args` (all optional): {"name", "observation_key" (default "prompt"; the whole observation as JSON
when absent), "action_key" (default "message"), "system_prompt", "max_turns", "size" (training episodes: reset
seeds 0..size-1, default 1000; eval episodes use the seeds after them), "reset_kwargs" (dict), "step_timeout"
(seconds, default 30), "startup_timeout" (seconds, default 60)}.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import secrets
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from vime.config.agents import AgentConfig
from vime.config.rollout import PromptDataConfig
from vime.config.run import JobConfig
from vime.environments.base import (ENVIRONMENT_KEY, Environment, EnvironmentSpec, import_optional, prompt_sample,
                                    record_functions)
from vime.data.sample import Sample
from vime.utils.listeners import foreign_listener, listeners
from vime.utils.process import kill_tree, spawn, tail, wait_until

logger = logging.getLogger(__name__)
EPISODE_KEY = "openenv"  # metadata: {"seed": reset seed} in; {"rewards", "done", "steps"} after the episode
DEFAULTS = {"observation_key": "prompt", "action_key": "message", "system_prompt": None, "max_turns": None,
            "size": 1000, "reset_kwargs": {}, "step_timeout": 30.0, "startup_timeout": 60.0}


# the server vime starts is on loopback: its token never goes through a proxy the environment names
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(url: str, timeout_s: float = 2.0, headers: dict[str, str] | None = None) -> bool:
    """Whether GET /health answers 200; with `headers` (a token) the request goes straight to `url`."""
    request = urllib.request.Request(f"{url}/health", headers=headers or {})
    try:
        with (_DIRECT.open if headers else urllib.request.urlopen)(request, timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


class OpenEnvServer:
    """An OpenEnv app served by a process this run owns, on a loopback port, behind a token of its own
    (`openenv_server`): `headers` are what the run's requests carry."""

    def __init__(self, app: str, startup_timeout: float, log_dir: Path):
        from vime.utils.misc import find_free_port

        module, _, attr = app.partition(":")
        self.app = app
        self.port = find_free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"openenv_{module.replace('.', '_')}_{self.port}.log"
        self._token = secrets.token_hex(32)
        # the run's import path, so that an app module next to the run's code (not installed) imports too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)}
        # the token on standard input: argv is readable by every user, the environment by the app's children
        self.proc = spawn([sys.executable, "-m", "vime.environments.openenv_server", f"{module}:{attr or 'app'}",
                           "--host", "127.0.0.1", "--port", str(self.port)], self.log, env=env,
                          stdin_data=f"{self._token}\n".encode())
        self._wait_serving(startup_timeout)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_serving(self, timeout_s: float) -> None:
        """Wait until the server listens and answers /health. Nothing, not even /health, goes to the port before
        its listener is known to be this server: the port was free when chosen, and anyone may bind it first."""
        deadline = time.monotonic() + timeout_s
        alive = lambda: self.proc.poll() is None  # noqa: E731
        if wait_until(lambda: bool(listeners(self.port)), timeout_s, 0.05, alive=alive):
            stranger = foreign_listener(self.port, self.proc.pid)
            if stranger is not None:
                self.stop()
                raise RuntimeError(f"--environment openenv:{self.app}: {stranger}; nothing was sent to it. Another "
                                   "user may be trying to impersonate the environment server: start the run again "
                                   "(a new port is chosen) and tell the node's administrator")
            healthy = lambda: _healthy(self.url, headers=self.headers)  # noqa: E731
            if wait_until(healthy, max(deadline - time.monotonic(), 0.0), 0.3, alive=alive):
                return
        self.stop()
        raise RuntimeError(f"--environment openenv:{self.app}: the server did not become healthy within "
                           f"{timeout_s:g}s (exit code {self.proc.returncode}); its log {self.log}:\n{tail(self.log)}")

    def check_running(self) -> None:
        """Raise when the server has exited: its port is free again, and whoever binds it next would be sent the
        token and every model turn."""
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"--environment openenv:{self.app}: the server vime started exited (code {code}); "
                               f"nothing more is sent to its port. Its log {self.log}:\n{tail(self.log)}")

    def stop(self) -> None:
        kill_tree(self.proc, grace_s=5.0)  # also reaps what is left of a server that died


@functools.cache
def _token_client_class():
    """GenericEnvClient whose WebSocket handshake carries the server's token (`headers`): openenv-core's own
    `connect` sends no header. It connects directly, never through a proxy the environment names."""
    from openenv.core.generic_client import GenericEnvClient
    from websockets.asyncio.client import connect as ws_connect

    class TokenEnvClient(GenericEnvClient):
        def __init__(self, *args, headers: dict[str, str], **kwargs):
            super().__init__(*args, **kwargs)
            self._headers = headers

        async def connect(self):
            if self._ws is None:
                try:
                    self._ws = await ws_connect(self._ws_url, open_timeout=self._connect_timeout,
                                                max_size=self._max_message_size, additional_headers=self._headers,
                                                proxy=None)
                except Exception as e:  # noqa: BLE001 - what openenv-core's connect raises for any failure
                    raise ConnectionError(f"Failed to connect to {self._ws_url}: {e}") from e
            return self

    return TokenEnvClient


class OpenEnvEnvironment(Environment):
    def __init__(self, target: str, config: dict[str, Any], args):
        job = JobConfig.of(args)
        import_optional("openenv.core.generic_client", "openenv", "openenv-core")
        unknown = sorted(set(config) - set(DEFAULTS) - {"name"})
        if unknown:
            raise ValueError(f"--environment-args for openenv:{target}: unknown keys {', '.join(unknown)}; known: "
                             f"{', '.join(['name', *DEFAULTS])}")
        self.config = {**DEFAULTS, **config}
        self.server: OpenEnvServer | None = None
        if target.startswith(("http://", "https://")):
            self.url = target.rstrip("/")
            if not _healthy(self.url, timeout_s=10.0):
                raise ValueError(f"--environment openenv:{target}: no healthy OpenEnv server there (GET /health)")
        else:
            log_dir = Path(job.output_dir or tempfile.gettempdir()) / "logs"
            self.server = OpenEnvServer(target, float(self.config["startup_timeout"]), log_dir)
            self.url = self.server.url
        # default name: the app module's last part (pkg.envs.digits -> digits), "openenv" for a URL
        self.name = str(config.get("name") or ("openenv" if self.server is None else
                                               target.partition(":")[0].rsplit(".", 1)[-1]))
        self.max_turns = self.config["max_turns"]

    def _prompts(self, seeds, args) -> list[Sample]:
        # the prompt comes from the environment's reset, when the episode starts: no tokens yet
        return [Sample(prompt="", tokens=[], metadata={ENVIRONMENT_KEY: self.name, EPISODE_KEY: {"seed": seed}})
                for seed in seeds]

    def train_prompts(self, tokenizer, args) -> list[Sample]:
        return self._prompts(range(int(self.config["size"])), args)

    def eval_prompts(self, tokenizer, args, n: int) -> list[Sample]:
        size = int(self.config["size"])
        return self._prompts(range(size, size + n), args)

    def _client(self, timeout: float):
        """A session client; for the server vime started, one that sends its token, made only while the server runs."""
        if self.server is None:
            from openenv.core.generic_client import GenericEnvClient

            return GenericEnvClient(base_url=self.url, connect_timeout_s=timeout, message_timeout_s=timeout)
        self.server.check_running()
        return _token_client_class()(base_url=self.url, connect_timeout_s=timeout, message_timeout_s=timeout,
                                     headers=self.server.headers)

    def _text(self, observation: dict[str, Any]) -> str:
        key = self.config["observation_key"]
        if key in observation:
            return str(observation[key])
        return json.dumps(observation, sort_keys=True)

    async def generate(self, args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
        prompt_data = PromptDataConfig.of(args)
        from vime.agents.multi_turn import generate as multi_turn_generate
        from vime.rollout.vllm_rollout import GenerateState

        timeout = float(self.config["step_timeout"])
        episode = sample.metadata[EPISODE_KEY]
        client = self._client(timeout)
        rewards: list[float] = []
        try:
            await asyncio.wait_for(client.connect(), timeout)
            first = await asyncio.wait_for(client.reset(seed=episode["seed"], **self.config["reset_kwargs"]), timeout)
            messages = [{"role": "user", "content": self._text(first.observation)}]
            if self.config["system_prompt"]:
                messages.insert(0, {"role": "system", "content": self.config["system_prompt"]})
            prompt = prompt_sample(messages if prompt_data.apply_chat_template else messages[-1]["content"],
                                   GenerateState(args).tokenizer, args, environment=self.name)
            sample.prompt, sample.tokens = prompt.prompt, list(prompt.tokens)
            episode["done"] = bool(first.done)

            async def step(args, sample, model_text: str, turn: int):
                result = await asyncio.wait_for(client.step({self.config["action_key"]: model_text}), timeout)
                rewards.append(float(result.reward or 0.0))
                episode["done"] = bool(result.done)
                return None if result.done else [{"role": "user", "content": self._text(result.observation)}]

            if not first.done:
                max_turns = int(self.max_turns or AgentConfig.of(args).agent_max_turns)
                await multi_turn_generate(args, sample, sampling_params, environment=step, max_turns=max_turns)
                if sample.metadata.get("stop") == "max_turns":  # the last model turn is an action too: its reward
                    last = sample.metadata["turns"][-1]
                    ids = sample.response_tokens[last["start"]:last["start"] + last["length"]]
                    await step(args, sample, GenerateState(args).tokenizer.decode(ids, skip_special_tokens=True), 0)
        finally:
            episode["rewards"], episode["steps"] = rewards, len(rewards)
            await client.close()
        return sample

    async def score(self, args, sample: Sample) -> float:
        episode = sample.metadata.get(EPISODE_KEY) or {}
        total = float(sum(episode.get("rewards") or []))
        record_functions(sample, {"episode_return": total, "terminated": float(bool(episode.get("done")))},
                         {"episode_return": 1.0, "terminated": 0.0})
        return total

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def load(spec: EnvironmentSpec, args) -> list[OpenEnvEnvironment]:
    env = OpenEnvEnvironment(spec.target, spec.config, args)
    env.weight = spec.weight
    return [env]
