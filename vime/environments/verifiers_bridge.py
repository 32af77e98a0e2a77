"""The verifiers side of `--environment verifiers:...`: a program vime runs with the verifiers venv's Python.

verifiers 0.4 requires openai<3 and mcp==2.0.0, which vime's own venv cannot hold beside openai-agents, so vime
never imports verifiers: it starts this file as a child process (`verifiers_env.VerifiersBridge`) and talks to it
in JSON lines, one object a line, over stdin/stdout (stdout carries nothing else; logs go to stderr). This file
imports only the standard library at module level and nothing of vime.

    vime -> bridge  {"id": 0, "op": "load", "target": "<taskset id or module>", "config": {EnvConfig fields},
                     "size": int | null, "take": int | null}
    bridge -> vime  {"id": 0, "tasks": [{"idx", "key", "prompt", "system_prompt", "answer"}],
                     "env_id": str, "rewards": {name: weight}}
    vime -> bridge  {"id": n, "op": "episode", "task": idx, "session": ID, "key": KEY, "base_url": URL,
                     "timeout": s}
    bridge -> vime  {"id": n, "ok": bool, "errors": [str], "traces": [{"session", "agent", "ok", "errors",
                     "stop", "reward", "rewards": {name: [score | null, weight]}, "metrics": {name: value}}]}
    vime -> bridge  {"id": n, "op": "cancel"}      the episode of request n is abandoned
    vime -> bridge  {"op": "close"}                 stop serving (tool servers, interception) and exit
    bridge -> vime  {"id": n, "error": "..."}      request n failed (a bad environment, a bug here)

An episode is verifiers' own `Env.run_episode`: its harness (a program verifiers launches) chats through
verifiers' interception server, whose model client relays every call to vime's OpenAI-compatible endpoint
(`base_url`). Each trace's id is set to the session it belongs to (`ID` for the first agent of the episode,
`ID/<agent>` for others) the moment verifiers mints it: verifiers sends the trace id as the `X-Session-ID` header
of every relayed call, which is how vime's endpoint knows the episode and records its exact tokens. ID is the
episode's public id, no credential (verifiers may write a trace id on a harness program's command line, which
every user of the node can read); the relay proves itself with KEY, its API key (`OpenAIServer.relay_key`),
which opens only the episodes of this bridge (`OpenAIServer.bind_relay`). KEY arrives on stdin and lives in this
process's `os.environ` only while an episode runs (verifiers reads a client's API key from there, on every
relayed call), under a name with API_KEY in it (`RELAY_KEY_ENV`): verifiers strips such names from the
environment of every program it launches, so a harness program, which runs the policy's commands, never inherits it.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import sys
import traceback
from typing import Any

LEGACY_HINT = ("it looks written against verifiers' pre-0.4 API (load_environment() returning SingleTurnEnv, "
               "ToolEnv, MultiTurnEnv with a Rubric), which verifiers 0.4.0 removed: port it to a verifiers.v1 "
               "Taskset (a Task with @vf.reward methods, exported in the module's __all__), or run it with "
               "verifiers<0.4 outside vime")
# where verifiers' model client reads its API key from; "API_KEY" in the name keeps it out of the programs verifiers
# launches (its subprocess runtime drops every such name from the environment they inherit)
RELAY_KEY_ENV = "VIME_VERIFIERS_RELAY_API_KEY"
MODEL = "policy"  # the name the harness asks for; vime's endpoint serves the run's policy whatever it is called


def taskset_id(target: str) -> str:
    """The id verifiers loads the taskset by. verifiers imports a plugin by its bare name (`import_taskset`), so
    a dotted local module (`pkg.envs.my_env`) is imported here and registered under a top-level alias."""
    if "." not in target or "/" in target:
        return target  # an installed package or hub id (owner/name@version), verifiers resolves it
    alias = target.replace(".", "__")
    sys.modules[alias] = importlib.import_module(target)
    return alias


def check_module(ident: str) -> None:
    """A clear error for a module that is no v1 taskset (verifiers would fall back to an empty default env)."""
    from verifiers.v1 import Taskset
    from verifiers.v1.utils.loaders import import_taskset

    module = import_taskset(ident)
    exported = [getattr(module, n, None) for n in getattr(module, "__all__", [])]
    if any(isinstance(o, type) and issubclass(o, Taskset) and o is not Taskset for o in exported):
        return
    if hasattr(module, "load_environment"):
        raise ValueError(f"{module.__name__} has load_environment() but exports no verifiers.v1 Taskset: "
                         f"{LEGACY_HINT}")
    raise ValueError(f"{module.__name__} exports no verifiers.v1 Taskset subclass in __all__ (and has no "
                     "load_environment() either): it is not a verifiers environment")


def env_config(ident: str, config: dict[str, Any]):
    """The `EnvConfig` for the taskset with vime's defaults for each agent the config leaves open: the
    `subprocess` runtime (the harness runs on this node, against the run's endpoint) and, unless the taskset
    bundles a harness, verifiers' `null` harness (chat plus the taskset's MCP tools) rather than its `bash`
    coding agent, which would run the policy's shell commands on this node."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    raw = {**config, "taskset": {**(config.get("taskset") or {}), "id": ident}}
    roles = agent_config_fields(vf.resolve_env_config(raw))
    plain = vf.default_harness_id(ident) == "bash"
    for role in roles:
        seat = dict(raw.get(role) or {})
        seat.setdefault("runtime", {"type": "subprocess"})
        if plain:
            seat.setdefault("harness", {"id": "null"})
        raw[role] = seat
    return vf.resolve_env_config(raw)


def _json_value(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return value


def task_row(task) -> dict[str, Any]:
    data = task.data
    answer = getattr(data, "answer", None)
    return {"idx": data.idx, "key": task.key, "prompt": _json_value(data.prompt), "system_prompt": data.system_prompt,
            "answer": None if answer is None else _json_value(answer)}


def reward_weights(task_cls, task_config) -> dict[str, float]:
    """Each reward function of the task class and its weight (decorated methods and config-plugged ones)."""
    weights = {}
    for name in dir(task_cls):
        fn = getattr(task_cls, name, None)
        if callable(fn) and getattr(fn, "reward", False) is True:
            weights[name] = float(getattr(fn, "_vf_weight", 1.0))
    for name, plugged in (getattr(task_config, "rewards", None) or {}).items():
        weights[name] = float(plugged.weight if plugged.weight is not None else weights.get(name, 1.0))
    return weights


def trace_record(trace) -> dict[str, Any]:
    rewards = {name: [None if r is None else float(r.score), None if r is None else float(r.weight)]
               for name, r in trace.rewards.items()}
    metrics = {name: float(v) for name, v in (trace.metrics or {}).items() if isinstance(v, (int, float))}
    return {"session": trace.id, "agent": trace.agent.name, "ok": bool(trace.ok), "stop": trace.stop_condition,
            "calls": len(trace.calls),
            "errors": [f"{e.type}: {e.message}" for e in trace.errors], "reward": float(trace.reward),
            "rewards": rewards, "metrics": metrics}


class Bridge:
    def __init__(self, out):
        self.out = out  # the protocol stream (the original stdout)
        self.env = None
        self.tasks: dict[int, Any] = {}
        self.running: dict[Any, asyncio.Task] = {}
        self.closing = asyncio.Event()
        self.key_holders = 0  # episodes running with the relay key in os.environ (`hold_relay_key`)

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        import verifiers.v1 as vf

        ident = taskset_id(request["target"])
        check_module(ident)
        self.env = vf.load_environment(env_config(ident, request.get("config") or {}))
        taskset = self.env.taskset
        take = request.get("take")
        if take is not None:
            taskset = taskset.take(int(take))
        elif not taskset.bounded:
            raise ValueError(f"taskset {request['target']} is infinite: give its size in --environment-args "
                             "({\"size\": N})")
        tasks = list(taskset)
        self.tasks = {task.data.idx: task for task in tasks}
        task_cls = type(self.env.taskset).task_type()
        return {"tasks": [task_row(t) for t in tasks], "env_id": self.env.config.env_id,
                "rewards": reward_weights(task_cls, self.env.taskset.config.task)}

    async def episode(self, request: dict[str, Any]) -> dict[str, Any]:
        from verifiers.v1.clients import EvalClientConfig, ModelContext

        task = self.tasks[int(request["task"])]
        token = request["session"]
        named: list[str] = []

        def name_trace(trace) -> None:
            # the first agent's trace is the episode's main session; others are ID/<agent>[#k]
            session = token if not named else f"{token}/{trace.agent.name or 'agent'}"
            while session in named:
                session += "#"
            named.append(session)
            trace.id = session

        # Relayed to vime's endpoint under the episode's public id (X-Session-ID) with the relay key as the API
        # key: the public id may land on a command line (a toolset's URL); the key is where verifiers reads an API
        # key from, this process's os.environ, only while episodes run (`hold_relay_key`).
        client = EvalClientConfig(base_url=request["base_url"], api_key_var=RELAY_KEY_ENV)
        ctx = ModelContext(model=MODEL, client=client)
        self.hold_relay_key(request["key"])
        try:
            episode = await asyncio.wait_for(self.env.run_episode(task, ctx, on_trace=name_trace),
                                             float(request.get("timeout") or 3600))
        finally:
            self.release_relay_key()
        return {"ok": bool(episode.ok), "errors": [f"{e.type}: {e.message}" for e in episode.errors],
                "traces": [trace_record(t) for t in episode.traces]}

    def hold_relay_key(self, key: str) -> None:
        """The relay key in os.environ for one more running episode (verifiers resolves it on each relayed call)."""
        os.environ[RELAY_KEY_ENV] = key
        self.key_holders += 1

    def release_relay_key(self) -> None:
        """One episode fewer; the last one takes the key out of os.environ, so nothing started between episodes
        (a tool server, a taskset's own program) inherits it, whatever its name."""
        self.key_holders -= 1
        if not self.key_holders:
            os.environ.pop(RELAY_KEY_ENV, None)

    async def answer(self, request: dict[str, Any]) -> None:
        rid = request.get("id")
        try:
            reply = await self.episode(request)
        except asyncio.CancelledError:
            return  # vime gave up on it (cancel, close): nobody waits for an answer
        except (Exception, SystemExit) as e:  # noqa: BLE001 - each request answers for itself; the bridge serves on
            # (verifiers raises SystemExit for a missing Prime login, e.g. a remote runtime's tunnel)
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            self.running.pop(rid, None)
        self.send({"id": rid, **reply})

    async def serve(self) -> None:
        """Read requests until close or end of input; episodes run concurrently inside `Env.serving()`."""
        loop = asyncio.get_running_loop()
        first = json.loads(await loop.run_in_executor(None, sys.stdin.readline) or "{}")
        try:
            self.send({"id": first.get("id"), **self.load(first)})
        except (Exception, SystemExit) as e:  # noqa: BLE001 - any load failure is the environment's: report, exit
            self.send({"id": first.get("id"), "error": f"{type(e).__name__}: {e}"})
            return
        async with self.env.serving():
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line:
                    break
                request = json.loads(line)
                op = request.get("op")
                if op == "close":
                    break
                if op == "cancel":
                    running = self.running.pop(request.get("id"), None)
                    if running is not None:
                        running.cancel()
                elif op == "episode":
                    self.running[request.get("id")] = asyncio.create_task(self.answer(request))
                else:
                    self.send({"id": request.get("id"), "error": f"unknown op {op!r}"})
            for running in list(self.running.values()):
                running.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)


def main() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (the library's, a taskset's) must not corrupt the protocol stream
    loop = asyncio.new_event_loop()
    bridge = Bridge(out)
    main_task = loop.create_task(bridge.serve())
    # SIGTERM (vime closing the run): leave Env.serving() so verifiers stops the tool servers it started
    loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
    code = 0
    try:
        loop.run_until_complete(main_task)
    except asyncio.CancelledError:
        pass
    except BaseException:  # noqa: BLE001 - e.g. Env.serving() failing: say why (vime shows the log), then exit
        traceback.print_exc()
        code = 1
    out.flush()
    os._exit(code)  # not sys.exit: a thread may still block reading stdin, and exit would wait for it


if __name__ == "__main__":
    main()
