"""Flags of the multi-turn agent rollout (`vime.agents.multi_turn.generate`).

Their types and defaults are `vime.config.agents.AgentConfig`'s; the generate function reads them through it
(`AgentConfig.of(args)`), so it works with or without them on the command line.
"""

from __future__ import annotations

import argparse

from vime.config.agents import AgentConfig
from vime.config.section import apply_defaults


def add_agent_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agents (multi-turn tool use; --custom-generate-function-path "
                                  "vime.agents.multi_turn.generate)")
    g.add_argument("--agent-max-turns", type=int,
                   help="Model turns per episode; tool turns in between do not count (default: %(default)s). "
                        "All turns together share --rollout-max-response-len tokens.")
    g.add_argument("--agent-max-turn-tokens", type=int,
                   help="New tokens one model turn may take; a turn cut there still gets an environment answer "
                        "(default: None = whatever is left of --rollout-max-response-len).")
    g.add_argument("--agent-tools", nargs="+",
                   help="Tools offered to samples without a `tools` field (default: calculator python).")
    g.add_argument("--agent-tool-paths", nargs="+",
                   help="module.attr of extra vime.agents.tools.Tool objects to register (default: %(default)s).")
    g.add_argument("--agent-tool-call-format", choices=("auto", "qwen", "json"),
                   help="How tool calls are written: <tool_call>{...}</tool_call>, a JSON object, or auto; "
                        "also how the agent endpoint parses a reply into structured tool_calls (default: %(default)s).")
    g.add_argument("--agent-tool-timeout", type=float,
                   help="Seconds one tool call may take; past it the model is told it timed out "
                        "(default: %(default)g).")
    g.add_argument("--agent-max-tool-output-chars", type=int,
                   help="Tool results are cut to this many characters before tokenizing (default: %(default)s).")
    g.add_argument("--agent-environment-path",
                   help="async step(args, sample, model_text, ctx) -> list of messages | None, run after each "
                        "model turn; None ends the episode (default: %(default)s).")
    g.add_argument("--agent-sandbox",
                   help="Where code runs: 'local' (LocalSandbox) or the URL of a sandbox service "
                        "(default: %(default)s).")
    g.add_argument("--agent-sandbox-allow-weak-isolation", action="store_true",
                   help="Run model code in a local sandbox even where it lacks network, pid or file-system isolation "
                        "(no unprivileged namespaces or Landlock, e.g. a default container); such runs are logged "
                        "and counted in rollout/sandbox_weak_isolation_runs (default: off = refuse to run).")
    apply_defaults(parser, AgentConfig)  # defaults: vime/config
