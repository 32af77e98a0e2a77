"""Flags of the multi-turn agent rollout (`vime.agents.multi_turn.generate`).

Each flag is a field of `vime.config.agents.AgentConfig` (type, default, help); the generate function reads them
through it (`AgentConfig.of(args)`), so it works with or without them on the command line.
"""

from __future__ import annotations

import argparse

from vime.config.agents import AgentConfig
from vime.config.section import add_flags


def add_agent_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agents (multi-turn tool use; --custom-generate-function-path "
                                  "vime.agents.multi_turn.generate)")
    add_flags(g, AgentConfig)
