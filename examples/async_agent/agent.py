"""A two-turn agent loop trained fully asynchronously (train_async.py): the model answers, is asked to check
its answer, and gives a final one; the final answer is scored. The loop only knows the `openai` client; vime's
endpoint records the exact tokens of both turns (the user's follow-up is context, loss mask 0).

    --custom-generate-function-path examples.async_agent.agent.generate
    --custom-rm-path vime.agents.harness.agent_reward
"""

from __future__ import annotations

import openai

from vime.agents.harness import agent_generate
from vime.rollout.rm_hub.math_rm import math_verify_reward

FOLLOW_UP = "Check it. Final answer?"


async def answer_then_check(base_url: str, session_id: str, sample) -> float:
    messages = [{"role": "user", "content": sample.prompt}]
    async with openai.AsyncOpenAI(base_url=base_url, api_key=session_id, max_retries=0) as client:
        first = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": FOLLOW_UP}]
        final = await client.chat.completions.create(model="policy", messages=messages)
    return math_verify_reward(final.choices[0].message.content or "", sample.label)  # None: an empty answer


generate = agent_generate(answer_then_check)
