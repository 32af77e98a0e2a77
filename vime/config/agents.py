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

    environment: list[str] | None = flag(
        None, "An environment to train on, repeatable (a mixture): reasoning_gym:<dataset>[,<dataset>...], "
        "openenv:<app module or http://host:port>, verifiers:<taskset id or module>. Its prompts, rewards (each "
        "reward function reported as its own metric) and, for multi-turn kinds, its turns replace --prompt-data and "
        "--rm-type (default: %(default)s).", action="append", metavar="KIND:TARGET")
    environment_weights: list[float] | None = flag(None, "Mixture weight of each --environment, in order: the share "
                                                   "of training groups drawn from it (default: 1 each).")
    environment_args: list[str] | None = flag(
        None, "A JSON object configuring an --environment, one per --environment in order when given ('{}' for "
        "none): an OpenEnv environment's settings, reasoning-gym dataset configs {\"<dataset>\": {...}}, a verifiers "
        "EnvConfig {\"taskset\": {...}, \"agent\": {...}} (default: %(default)s).", action="append", metavar="JSON")
    environment_eval_size: int = flag(0, "Prompts per environment in its own eval set (eval/<environment>/..., every "
                                      "--eval-interval rollouts); 0: no environment eval sets (default: %(default)s).")
    reasoning_gym_size: int = flag(1000, "Training entries generated per reasoning-gym dataset (default: "
                                   "%(default)s).")
    reasoning_gym_seed: int | None = flag(None, "Seed of reasoning-gym's generators (default: --seed).")
    reasoning_gym_weights: list[float] | None = flag(None, "Weight of each dataset of a reasoning_gym:<d1>,<d2>,... "
                                                     "spec within that environment's weight (default: equal).")
    reasoning_gym_system_prompt: str = flag("default", "System prompt of reasoning-gym prompts: a key of "
                                            "reasoning_gym.utils.SYSTEM_PROMPTS (default, DeepSeekZero, simple, "
                                            "direct, ...) or none (default: %(default)s).")
    verifiers_python: str | None = flag(None, "Python of the venv holding verifiers 0.4.0 (and the environments it "
                                        "loads), where vime runs a verifiers:... environment's bridge process; "
                                        "verifiers cannot share vime's venv (default: None = .venv-verifiers/bin/"
                                        "python at the repository root, made by scripts/install.sh).")


@dataclasses.dataclass(frozen=True)
class JudgeConfig(Section):
    """A judge or reward model the run serves (`--judge-*`)."""

    judge_checkpoint: str | None = flag(None, "HF checkpoint of a judge model the run serves on engines of its own, "
                                        "never updated; reward functions call it through "
                                        "`vime.environments.judge.run_judge()` (an OpenAI-compatible base_url and "
                                        "api_key, or its `chat` method) (default: None = no judge).")
    judge_num_engines: int = flag(1, "Engines serving the judge (default: %(default)s).")
    judge_max_tokens: int = flag(32, "Tokens a judge reply may take unless the call says otherwise (default: "
                                 "%(default)s).")
    judge_temperature: float = flag(0.0, "Sampling temperature of judge calls unless the call says otherwise "
                                    "(default: %(default)s).")
    judge_timeout: float = flag(60.0, "Seconds one judge call may take; past it the call raises and the sample it "
                                "scores fails (default: %(default)g).")
    judge_concurrency: int = flag(64, "Judge calls in flight at once, over its engines, which batch them (default: "
                                  "%(default)s).")

    def check(self) -> None:
        if self.judge_checkpoint is None:
            return
        for option, value in self.named("judge_num_engines", "judge_max_tokens", "judge_concurrency"):
            if value < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        if not self.judge_timeout > 0:
            raise ValueError(f"--judge-timeout must be > 0 seconds, got {self.judge_timeout}")
