"""The tool-use example's generate function and reward, plugged in by function path (vime's code untouched):

    --custom-generate-function-path examples.tool_use.agent.generate --custom-rm-path examples.tool_use.agent.reward
"""

from __future__ import annotations

from vime.agents import multi_turn
from vime.rollout.rm_hub.answer_utils import last_boxed
from vime.rollout.vllm_rollout import GenerateState


async def generate(args, sample, sampling_params):
    """Model turn -> calculator -> model turn, at most 3 model turns of at most 48 tokens each."""
    return await multi_turn.generate(args, sample, sampling_params, max_turns=3, max_turn_tokens=48)


async def reward(args, sample) -> float:
    """1.0 when the last model turn boxes the right number (tool output does not count as an answer)."""
    turns = multi_turn.model_turn_texts(GenerateState(args).tokenizer, sample)
    answer = last_boxed(turns[-1]) if turns else None
    return float(answer is not None and answer.strip() == str(sample.label))
