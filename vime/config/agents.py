"""Sections of agents and environments: multi-turn tools, the agent harness, environment libraries, the judge."""

from __future__ import annotations

import dataclasses
from typing import Literal

from vime.config.section import Section


@dataclasses.dataclass(frozen=True)
class AgentConfig(Section):
    """Multi-turn tool use (`--agent-*` for vime.agents.multi_turn)."""

    agent_max_turns: int = 4
    agent_max_turn_tokens: int | None = None
    agent_tools: list[str] = dataclasses.field(default_factory=lambda: ["calculator", "python"])
    agent_tool_paths: list[str] | None = None
    agent_tool_call_format: Literal["auto", "qwen", "json"] = "auto"
    agent_tool_timeout: float = 10.0
    agent_max_tool_output_chars: int = 2000
    agent_environment_path: str = "vime.agents.multi_turn.tool_environment"
    agent_sandbox: str = "local"
    agent_sandbox_allow_weak_isolation: bool = False


@dataclasses.dataclass(frozen=True)
class HarnessConfig(Section):
    """Agents run against vime's OpenAI-compatible endpoint (`--agent-function-path`, ...)."""

    agent_function_path: str | None = None
    agent_timeout: float = 600.0
    agent_endpoint_port: int = 0
    agent_endpoint_max_request_mb: float = 16.0
    agent_use_request_sampling: bool = False


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
        for flag, value in self.named("judge_num_engines", "judge_max_tokens", "judge_concurrency"):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not self.judge_timeout > 0:
            raise ValueError(f"--judge-timeout must be > 0 seconds, got {self.judge_timeout}")
