"""Flags of the agent harness (`vime.agents.harness`): the user's agent function and its endpoint.

Their types and defaults are `vime.config.agents.HarnessConfig`'s; the harness reads them through it
(`HarnessConfig.of(args)`), so it works with or without registration.
"""

from __future__ import annotations

import argparse

from vime.config.agents import HarnessConfig
from vime.config.section import apply_defaults


def add_agent_harness_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("agent harness", "An agent loop driving the policy through an OpenAI-compatible "
                                  "endpoint (--custom-generate-function-path vime.agents.harness.generate).")
    g.add_argument("--agent-function-path",
                   help="The agent: `[async] fn(base_url, session_id, sample)` that chats with the policy through "
                        "the openai client at base_url with api_key=session_id (or session_id + '/ROLE' for "
                        "each agent of a multi-agent episode) and returns a reward, {role: reward}, a final "
                        "answer string or None (default: %(default)s).")
    g.add_argument("--agent-timeout", type=float,
                   help="Seconds one agent episode may take before it counts as failed (default: %(default)g).")
    g.add_argument("--agent-endpoint-port", type=int,
                   help="Port of the OpenAI-compatible endpoint in the rollout process; 0 picks a free one "
                        "(default: %(default)s).")
    g.add_argument("--agent-endpoint-max-request-mb", type=float,
                   help="Largest chat request body the endpoint reads, in MiB; a larger one is answered 413. "
                        "Parsing a body holds the rollout process's GIL (about 1.5 ms per MiB), so a higher limit "
                        "lets one request delay every agent's calls (default: %(default)g).")
    g.add_argument("--agent-use-request-sampling", action="store_true",
                   help="Use the agent's own temperature/top_p/top_k instead of --rollout-temperature/top-p/top-k. "
                        "Off by default because the trainer computes log-probs at the rollout temperature "
                        "(default: off).")
    apply_defaults(parser, HarnessConfig)  # defaults: vime/config

