"""The coding agent's generate function and reward, plugged in by function path (vime's code untouched):

    --custom-generate-function-path examples.coding_agent.agent.generate
    --custom-rm-path examples.coding_agent.agent.reward

The model may run code with the `python` tool (in the sandbox) before answering; its final code block runs in the
sandbox on the hidden tests' expressions (the sample's label), and the values are compared with the expected ones
outside it (`grading.py`).
"""

from __future__ import annotations

import re

from examples.coding_agent.grading import grade
from vime.agents import multi_turn
from vime.agents.sandbox import Sandbox, SandboxLimits, make_sandbox
from vime.config.agents import AgentConfig
from vime.rollout.sandbox_runs import record_sandbox_run
from vime.rollout.vllm_rollout import GenerateState

CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)
_sandboxes: dict[tuple[str, bool], Sandbox] = {}


def _sandbox(args) -> Sandbox:
    """The --agent-sandbox (local by default), refusing weak isolation unless --agent-sandbox-allow-weak-isolation."""
    agent = AgentConfig.of(args)
    key = (agent.agent_sandbox, agent.agent_sandbox_allow_weak_isolation)
    if key not in _sandboxes:
        _sandboxes[key] = make_sandbox(key[0], allow_weak_isolation=key[1])
    return _sandboxes[key]


async def generate(args, sample, sampling_params):
    """Model turn -> python tool -> model turn, at most 3 model turns of at most 64 tokens each."""
    return await multi_turn.generate(args, sample, sampling_params, max_turns=3, max_turn_tokens=64)


def final_code(text: str) -> str | None:
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


async def reward(args, sample) -> float:
    """1.0 when the last model turn's code passes every hidden test in the sandbox (all of them ran), else 0.0."""
    turns = multi_turn.model_turn_texts(GenerateState(args).tokenizer, sample)
    code = final_code(turns[-1]) if turns else None
    if code is None:
        return 0.0
    score, sample.metadata["grading"] = await grade(_sandbox(args), code, sample.label, SandboxLimits(wall_time_s=5))
    record_sandbox_run(sample, "grading", sample.metadata["grading"]["sandbox_error"])  # counted in the rollout
    return score
