"""The `args` that custom functions receive: the run's flags, plus what vime decides after parsing.

vime's own code reads the parsed flags, which nothing writes after validation. A function written for slime also
reads, at call time, values that slime writes into its `args` once the run is up: above all the router's address
(a generate function posts to `http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`). Custom
functions (generate, rollout, eval, reward, reward post-process, dynamic and buffer filters, agent environment,
loss) therefore get a view: a copy of the flags with those values filled in (`RUNTIME_FIELDS`), under vime's names
and under slime's where the meaning is the same (`SLIME_NAMES`).

Owners: the rollout manager builds the view once per run (`plugin_view`), its engine fleet giving the router's
address (its front for plugins, which stays put when the router restarts); the training ranks get the same values
(`runtime_values` -> `plugin_view_from`). The router's front listens on the rollout manager's node.
"""

from __future__ import annotations

import argparse
import math
from typing import Any
from urllib.parse import urlsplit

from vime.config.rollout import RolloutConfig

# what the view adds to the flags (vime's names): name -> what it holds
RUNTIME_FIELDS = {
    "vllm_router_ip": "the host of the router's front for custom functions (loopback: it admits this user's "
                      "processes and adds the serving key, `router_gate`); None without engines (--debug-train-only)",
    "vllm_router_port": "its port, fixed for the run (a restarted router sits behind the same front)",
    "num_rollout": "the run's rollout count (--num-rollout, or resolved from --num-epoch and the prompt count)",
    "rollout_num_engines": "how many engines serve the rollouts (--rollout-num-gpus / --rollout-num-gpus-per-engine, "
                           "or the external engines given)",
}
# slime's name -> vime's, for values whose meaning is the same
SLIME_NAMES = {"sglang_router_ip": "vllm_router_ip", "sglang_router_port": "vllm_router_port"}
# every name the view sets over the flags
VIEW_FIELDS = (*RUNTIME_FIELDS, "sglang_server_concurrency", *SLIME_NAMES)


def plugin_view(args: argparse.Namespace, router_url: str | None, num_rollout: int | None,
                num_engines: int) -> argparse.Namespace:
    """A copy of the flags `args` with the run-time values; the flags themselves are not touched."""
    rollout = RolloutConfig.of(args)
    view = argparse.Namespace(**vars(args))
    view.num_rollout = num_rollout
    view.rollout_num_engines = num_engines
    # slime's per-engine limit: its GenerateState and HTTP clients take sglang_server_concurrency x engines, which
    # is then vime's --rollout-concurrency (the limit over all engines)
    view.sglang_server_concurrency = max(1, math.ceil(rollout.rollout_concurrency / max(num_engines, 1)))
    move_router(view, router_url)
    return view


def move_router(view: argparse.Namespace, router_url: str | None) -> None:
    """Point the view's router fields (vime's and slime's names) at `router_url` ("http://host:port")."""
    host = port = None
    if router_url:
        parts = urlsplit(router_url)
        host, port = parts.hostname, parts.port
    view.vllm_router_ip, view.vllm_router_port = host, port
    for slime, ours in SLIME_NAMES.items():
        setattr(view, slime, getattr(view, ours))


def runtime_values(view: argparse.Namespace) -> dict[str, Any]:
    """The view's run-time values (plain JSON): what another process needs to build the same view."""
    return {name: getattr(view, name) for name in VIEW_FIELDS}


def plugin_view_from(args: argparse.Namespace, values: dict[str, Any] | None) -> argparse.Namespace:
    """The view in another process (a training rank): `args` with the `runtime_values` of the manager's view.
    Unknown names are refused: only the fields above may differ from the flags."""
    view = argparse.Namespace(**vars(args))
    unknown = set(values or {}) - set(VIEW_FIELDS)
    if unknown:
        raise ValueError(f"plugin values {sorted(unknown)} are not run-time fields ({sorted(RUNTIME_FIELDS)})")
    for name, value in (values or {}).items():
        setattr(view, name, value)
    return view
