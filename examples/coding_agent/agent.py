"""The coding agent's generate function and reward, plugged in by function path (vime's code untouched):

    --custom-generate-function-path examples.coding_agent.agent.generate
    --custom-rm-path examples.coding_agent.agent.reward

The model may run code with the `python` tool (in the sandbox) before answering; its final code block is
graded by running the hidden tests (the sample's label) in the sandbox too.
"""

from __future__ import annotations

import re

from vime.agents import multi_turn
from vime.agents.sandbox import LocalSandbox, SandboxLimits
from vime.rollout.vllm_rollout import GenerateState

CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)
_sandbox = LocalSandbox()


async def generate(args, sample, sampling_params):
    """Model turn -> python tool -> model turn, at most 3 model turns of at most 64 tokens each."""
    return await multi_turn.generate(args, sample, sampling_params, max_turns=3, max_turn_tokens=64)


def final_code(text: str) -> str | None:
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


async def reward(args, sample) -> float:
    """1.0 when the last model turn's code passes every hidden test in the sandbox, else 0.0."""
    turns = multi_turn.model_turn_texts(GenerateState(args).tokenizer, sample)
    code = final_code(turns[-1]) if turns else None
    if code is None:
        return 0.0
    result = await _sandbox.run(code=code + "\n\n" + sample.label + "\n", limits=SandboxLimits(wall_time_s=5))
    sample.metadata["grading"] = {"exit_code": result.exit_code, "stopped_reason": result.stopped_reason,
                                  "stderr": result.stderr[-500:]}
    return 1.0 if result.ok else 0.0
