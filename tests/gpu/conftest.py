"""Shared by the GPU tests (tests/gpu): how many GPUs there are, and vime's flags parsed where vLLM is missing.

A GPU machine may hold torch and megatron-core but no vLLM (nor vllm-router): vLLM's CUDA build cannot always be
installed there. vime's parser mirrors every `--vllm-*` flag from vLLM's own parser and every `--router-*` flag
from vllm-router's, so without them it cannot even start; `allow_parsing_without_vllm` leaves those two groups
empty instead, which is all a test that only trains or moves weights needs. It changes nothing where they are
installed, and tests that start engines skip themselves without vLLM.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def installed(module: str) -> bool:
    """Whether top-level `module` can be imported here (found on the path; not imported)."""
    return importlib.util.find_spec(module) is not None


def allow_parsing_without_vllm() -> list[str]:
    """Let `vime.arguments.parse_args` run without vLLM / vllm-router: their flag groups are left empty. Returns
    what was stubbed ([] where both are installed). Call it in every process that parses vime's flags."""
    stubbed = []
    if not installed("vllm"):
        from vime.engine.control import arguments as vllm_arguments

        vllm_arguments.vllm_option_table = lambda: []  # no --vllm-* flags: none is given by these tests
        stubbed.append("vllm")
    if not installed("vllm_router"):
        import vime.arguments

        def router_args(parser):  # vime's own two router flags; vllm-router's are mirrored from its parser
            group = parser.add_argument_group("vllm-router")
            group.add_argument("--vllm-router-ip", default=None)
            group.add_argument("--vllm-router-port", type=int, default=None)
            parser.set_defaults(router_policy="round_robin")

        vime.arguments.add_router_args = router_args
        stubbed.append("vllm_router")
    return stubbed


@pytest.fixture(autouse=True, scope="session")
def _parse_without_vllm():
    allow_parsing_without_vllm()
