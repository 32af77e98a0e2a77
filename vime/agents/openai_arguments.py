"""Flags of the agent harness (`vime.agents.harness`): the user's agent function and its endpoint.

Each flag is a field of `vime.config.agents.HarnessConfig` (type, default, help); the harness reads them through it
(`HarnessConfig.of(args)`), so it works with or without registration.
"""

from __future__ import annotations

import argparse

from vime.config.agents import HarnessConfig
from vime.config.section import add_flags


def add_agent_harness_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agent harness", "An agent loop driving the policy through an OpenAI-compatible "
                                  "endpoint (--custom-generate-function-path vime.agents.harness.generate).")
    add_flags(g, HarnessConfig)
