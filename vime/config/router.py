"""The vllm-router section: where the router listens, and the defaults vime chooses over vllm-router's own.

vllm-router's other options are mirrored from its own CLI as `--router-*` (`add_router_args`) and passed through
as they are (`RunConfig.router_cli`), with vllm-router's defaults.
"""

from __future__ import annotations

import dataclasses

from vime.config.section import Section, flag


@dataclasses.dataclass(frozen=True)
class RouterConfig(Section):
    """The router's address, and vime's choices among vllm-router's options (`--vllm-router-*`, `--router-policy`)."""

    vllm_router_ip: str | None = flag(None, "Address of an already running vllm-router; vime starts one when unset "
                                      "(default: %(default)s).")
    vllm_router_port: int | None = flag(None, "Port of the router (started or external); a free port when unset "
                                        "(default: %(default)s).")
    # round robin spreads load evenly, which is what a rollout (many independent requests) wants
    router_policy: str = "round_robin"
    # vllm-router serves Prometheus metrics whatever it is told (None means 29000): a fixed port is contended by
    # two runs on a node, so each run's router gets a free loopback one unless the flag names one (`router_args_from`)
    router_prometheus_port: int | None = None
