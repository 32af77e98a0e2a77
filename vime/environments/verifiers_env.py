"""`--environment verifiers:<taskset id or module>`: a verifiers 0.4 (`verifiers.v1`) environment, unchanged.

- `verifiers:my-taskset` (an installed environment package, or a hub id `owner/name@version` installed into the
  verifiers venv) or `verifiers:pkg.envs.my_env` (a local module on the run's path): a module exporting its
  `vf.Taskset` subclass in `__all__`, as verifiers' docs write one.

verifiers runs in its own venv (`.venv-verifiers`, `--verifiers-python`), in a bridge process this environment
owns (`verifiers_process`, `verifiers_bridge.py`). The taskset's tasks are the prompt source. Each sample is one
verifiers episode (`Env.run_episode`): its harness (verifiers' `null` chat harness with the taskset's MCP tools
unless the taskset bundles one or the config names one; the `subprocess` runtime unless the config names one)
talks to the policy through verifiers' interception server, which relays each call to vime's OpenAI-compatible
endpoint (`vime.agents.harness.run_episode`): vime records the exact token ids, log-probs and loss masks there, as
for any agent (model tokens trained, tool results and other context masked). verifiers then scores the trace:
each `@vf.reward` function's score and weight are reported as their own metric, the reward is their weighted sum;
`@vf.metric` values ride along as weight-0 functions. A reward function that raises, or an episode that errs,
fails its sample.

verifiers 0.4 has no group-level reward functions (the v0 `Rubric` had them): its cross-agent judgement is an
`Env`'s `finalize()` over one episode, which runs whole inside the bridge before the traces are scored. A
multi-agent `Env`'s first agent is the sample; the others' sessions ride along as extra roles
(`vime.agents.harness.generate_rollout` makes them groups of their own).

`--environment-args` for a verifiers spec: verifiers' own `EnvConfig` fields (what its TOML `[env]` block holds:
{"taskset": {config fields}, "agent": {"harness": {...}, "sampling": {...}, "max_turns": ...}, ...}), plus vime's
keys "name" (default: the target's last part), "size" (training tasks: the first `size`; default all that the
eval set leaves; needed for an infinite taskset) and "startup_timeout" (seconds to load, default 180).
"""

from __future__ import annotations

import asyncio
import functools
import re
import tempfile
from pathlib import Path
from typing import Any

from vime.agents.openai_requests import public_id
from vime.config.agents import EnvironmentConfig, HarnessConfig
from vime.config.rollout import PromptDataConfig
from vime.config.run import JobConfig
from vime.data.sample import Sample
from vime.environments.base import ENVIRONMENT_KEY, Environment, EnvironmentSpec, record_functions
from vime.environments.verifiers_process import BridgeError, BridgeProcess, verifiers_python

TASK_KEY = "verifiers"  # metadata: {"task": idx} in; {"traces": [...], "errors": [...]} after the episode
VIME_KEYS = {"name": None, "size": None, "startup_timeout": 180.0}


def default_name(target: str) -> str:
    """`owner/my-env@1.0` -> `my_env`; `pkg.envs.my_env` -> `my_env`."""
    base = target.rsplit("/", 1)[-1].split("@", 1)[0].rsplit(".", 1)[-1]
    return re.sub(r"\W", "_", base)


def _plain(prompt: Any) -> str:
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return "" if prompt is None else str(prompt)


class VerifiersEnvironment(Environment):
    def __init__(self, spec: EnvironmentSpec, args):
        environments = EnvironmentConfig.of(args)
        job = JobConfig.of(args)
        own = {k: spec.config.get(k, default) for k, default in VIME_KEYS.items()}
        self.name = str(own["name"] or default_name(spec.target))
        self.weight = spec.weight
        self.size = None if own["size"] is None else int(own["size"])
        self.eval_size = int(environments.environment_eval_size or 0)
        self.startup_timeout = float(own["startup_timeout"])
        self.episode_timeout = float(HarnessConfig.of(args).agent_timeout)  # vime's deadline; the bridge's too
        config = {k: v for k, v in spec.config.items() if k not in VIME_KEYS}
        log_dir = Path(job.output_dir or tempfile.gettempdir()) / "logs"
        take = None if self.size is None else self.size + self.eval_size
        self.bridge = BridgeProcess(verifiers_python(environments.verifiers_python), spec.target, config, log_dir,
                                    self.name, take=take)
        self.relay_key: str | None = None  # the run's endpoint's key for this bridge (`OpenAIServer.relay_key`)
        self._tasks: list[dict[str, Any]] | None = None
        self.reward_weights: dict[str, float] = {}

    # ---- tasks -> prompts -----------------------------------------------------------------------------------
    def tasks(self) -> list[dict[str, Any]]:
        """The taskset's rows, as the bridge loaded them (waits for the bridge the first time)."""
        if self._tasks is None:
            loaded = self.bridge.loaded(self.startup_timeout)
            self._tasks, self.reward_weights = loaded["tasks"], loaded["rewards"]
            train = len(self._tasks) - self.eval_size if self.size is None else self.size
            if train < 1 or train + self.eval_size > len(self._tasks):
                raise ValueError(f"verifiers environment {self.name}: {len(self._tasks)} tasks, asked for "
                                 f"{train} training and {self.eval_size} eval tasks")
            self.size = train
        return self._tasks

    def _prompts(self, rows: list[dict[str, Any]], args) -> list[Sample]:
        # the prompt the model sees comes from the harness when the episode runs: no tokens yet
        prompt_data = PromptDataConfig.of(args)
        return [Sample(prompt=row["prompt"] if prompt_data.apply_chat_template else _plain(row["prompt"]), tokens=[],
                       label=None if row.get("answer") is None else str(row["answer"]),
                       metadata={ENVIRONMENT_KEY: self.name, TASK_KEY: {"task": row["idx"]}})
                for row in rows]

    def train_prompts(self, tokenizer, args) -> list[Sample]:
        rows = self.tasks()
        return self._prompts(rows[:self.size], args)

    def eval_prompts(self, tokenizer, args, n: int) -> list[Sample]:
        rows = self.tasks()
        return self._prompts(rows[self.size:self.size + n], args)

    # ---- one episode per sample -----------------------------------------------------------------------------
    async def _episode(self, endpoint, base_url: str, token: str, sample: Sample) -> None:
        """The agent function of `run_episode` (`endpoint`: the run's OpenAIServer): the bridge runs the task's
        verifiers episode against vime's endpoint, with `token` as its session; the traces' scores land in the
        sample's metadata."""
        task = sample.metadata[TASK_KEY]
        # The bridge names the episode by its public id and proves itself with the relay key: verifiers may put
        # a trace id on a harness program's command line, which every user of the node can read. The key opens
        # this bridge's episodes only.
        endpoint.bind_relay(token, self.relay_key)
        public = public_id(token)
        rid, future = self.bridge.request({"op": "episode", "task": task["task"], "session": public,
                                           "key": self.relay_key, "base_url": base_url,
                                           "timeout": self.episode_timeout})
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.bridge.cancel(rid)  # vime's episode timeout: the bridge stops the episode too
            raise
        if "error" in result:
            raise BridgeError(f"verifiers environment {self.name}, task {task['task']}: {result['error']}")
        for trace in result["traces"]:  # back to the sessions vime's endpoint recorded them under
            if trace["session"].startswith(public):
                trace["session"] = token + trace["session"][len(public):]
        # a new dict, not an update: the prompt's metadata may be shared with the rest of its group
        sample.metadata[TASK_KEY] = {**task, "traces": result["traces"], "errors": result["errors"]}
        if not any(t["calls"] for t in result["traces"]):
            why = "; ".join(result["errors"] + [e for t in result["traces"] for e in t["errors"]]) or "no error given"
            raise BridgeError(f"verifiers environment {self.name}, task {task['task']}: the episode made no model "
                              f"call ({why})")

    async def generate(self, args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
        from vime.agents.harness import get_server, run_episode

        endpoint = get_server(args)
        if self.relay_key is None:
            self.relay_key = endpoint.relay_key()
        return await run_episode(args, functools.partial(self._episode, endpoint), sample, sampling_params)

    async def score(self, args, sample: Sample) -> float:
        task = sample.metadata.get(TASK_KEY) or {}
        session = sample.metadata.get("agent_session")
        trace = next((t for t in task.get("traces") or [] if t["session"] == session), None)
        if trace is None:
            raise ValueError(f"sample {sample.index} of verifiers environment {self.name} has no scored trace")
        if trace["errors"]:
            raise RuntimeError(f"verifiers environment {self.name}, task {task['task']}: "
                               + "; ".join(trace["errors"]))
        unscored = sorted(name for name, (score, _) in trace["rewards"].items() if score is None)
        if unscored:
            raise RuntimeError(f"verifiers environment {self.name}, task {task['task']}: reward functions "
                               f"{', '.join(unscored)} gave no score")
        values = {name: score for name, (score, _) in trace["rewards"].items()}
        weights = {name: weight for name, (_, weight) in trace["rewards"].items()}
        for name, value in trace["metrics"].items():  # @vf.metric: reported, not rewarded
            if name not in values:
                values[name], weights[name] = value, 0.0
        record_functions(sample, values, weights)
        return float(trace["reward"])

    def close(self) -> None:
        self.bridge.close()


def load(spec: EnvironmentSpec, args) -> list[VerifiersEnvironment]:
    return [VerifiersEnvironment(spec, args)]
