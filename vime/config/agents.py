"""Sections of agents and environments: multi-turn tools, the agent harness, environment libraries, the judge."""

from __future__ import annotations

import dataclasses
from typing import Literal

from vime.config.section import Section, flag


@dataclasses.dataclass(frozen=True)
class AgentConfig(Section):
    """Multi-turn tool use (`--agent-*` for vime.agents.multi_turn)."""

    agent_max_turns: int = flag(4, "Model turns per episode; tool turns in between do not count (default: "
                                "%(default)s). All turns together share --rollout-max-response-len tokens.")
    agent_max_turn_tokens: int | None = flag(None, "New tokens one model turn may take; a turn cut there still gets "
                                             "an environment answer (default: None = whatever is left of "
                                             "--rollout-max-response-len).")
    agent_tools: list[str] = flag(["calculator", "python"],
                                  "Tools offered to samples without a `tools` field (default: calculator python).")
    agent_tool_paths: list[str] | None = flag(None, "module.attr of extra vime.agents.tools.Tool objects to "
                                              "register (default: %(default)s).")
    agent_tool_call_format: Literal["auto", "qwen", "json"] = flag(
        "auto", "How tool calls are written: <tool_call>{...}</tool_call>, a JSON object, or auto; also how the "
        "agent endpoint parses a reply into structured tool_calls (default: %(default)s).")
    agent_tool_timeout: float = flag(10.0, "Seconds one tool call may take; past it the model is told it timed out "
                                     "(default: %(default)g).")
    agent_max_tool_output_chars: int = flag(2000, "Tool results are cut to this many characters before tokenizing "
                                            "(default: %(default)s).")
    agent_environment_path: str = flag("vime.agents.multi_turn.tool_environment",
                                       "async step(args, sample, model_text, ctx) -> list of messages | None, run "
                                       "after each model turn; None ends the episode (default: %(default)s).")
    agent_sandbox: str = flag("local", "Where code runs: 'local' (LocalSandbox) or the URL of a sandbox service "
                              "(default: %(default)s).")
    agent_sandbox_allow_weak_isolation: bool = flag(
        False, "Run model code in a local sandbox even where it lacks network, pid or file-system isolation (no "
        "unprivileged namespaces or Landlock, e.g. a default container); such runs are logged and counted in "
        "rollout/sandbox_weak_isolation_runs (default: off = refuse to run).")


@dataclasses.dataclass(frozen=True)
class HarnessConfig(Section):
    """Agents run against vime's OpenAI-compatible endpoint (`--agent-function-path`, ...)."""

    agent_function_path: str | None = flag(
        None, "The agent: `[async] fn(base_url, session_id, sample)` that chats with the policy through the openai "
        "client at base_url with api_key=session_id (or session_id + '/ROLE' for each agent of a multi-agent "
        "episode) and returns a reward, {role: reward}, a final answer string or None (default: %(default)s).")
    agent_timeout: float = flag(600.0, "Seconds one agent episode may take before it counts as failed (default: "
                                "%(default)g).")
    agent_endpoint_port: int = flag(0, "Port of the OpenAI-compatible endpoint in the rollout process; 0 picks a "
                                    "free one (default: %(default)s).")
    agent_endpoint_max_request_mb: float = flag(
        16.0, "Largest chat request body the endpoint reads, in MiB; a larger one is answered 413. Parsing a body "
        "holds the rollout process's GIL (about 1.5 ms per MiB), so a higher limit lets one request delay every "
        "agent's calls (default: %(default)g).")
    agent_use_request_sampling: bool = flag(
        False, "Use the agent's own temperature/top_p/top_k instead of --rollout-temperature/top-p/top-k. Off by "
        "default because the trainer computes log-probs at the rollout temperature (default: off).")


@dataclasses.dataclass(frozen=True)
class EnvironmentConfig(Section):
    """Environment libraries: reasoning-gym, OpenEnv, verifiers (`--environment*`, ...)."""

    environment: list[str] | None = None
    environment_weights: list[float] | None = None
    environment_args: list[str] | None = None
    environment_eval_size: int = 0
    reasoning_gym_size: int = 1000
    reasoning_gym_seed: int | None = None
    reasoning_gym_weights: list[float] | None = None
    reasoning_gym_system_prompt: str = "default"
    verifiers_python: str | None = None


@dataclasses.dataclass(frozen=True)
class JudgeConfig(Section):
    """A judge or reward model the run serves (`--judge-*`)."""

    judge_checkpoint: str | None = None
    judge_num_engines: int = 1
    judge_max_tokens: int = 32
    judge_temperature: float = 0.0
    judge_timeout: float = 60.0
    judge_concurrency: int = 64

    def check(self) -> None:
        if self.judge_checkpoint is None:
            return
        for option, value in self.named("judge_num_engines", "judge_max_tokens", "judge_concurrency"):
            if value < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        if not self.judge_timeout > 0:
            raise ValueError(f"--judge-timeout must be > 0 seconds, got {self.judge_timeout}")
