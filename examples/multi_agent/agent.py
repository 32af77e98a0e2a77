"""Two agents cooperating on one task, each trained on its own tokens with its own reward.

The solver answers the question; the checker sees the question and the solver's answer and gives the final
answer (fixing it when it is wrong). Both are the same policy, driven through vime's OpenAI-compatible endpoint
with the ordinary `openai` client, one session per role ("<session>/solver", "<session>/checker"). The episode
returns per-agent rewards: each role is scored on its own answer.

    --custom-generate-function-path examples.multi_agent.agent.generate
    --custom-rm-path vime.agents.harness.agent_reward
    --rollout-function-path vime.agents.harness.generate_rollout   # one GRPO group per role
"""

from __future__ import annotations

import openai

from vime.agents.harness import agent_generate
from vime.rollout.rm_hub.math_rm import math_verify_reward


def checker_prompt(question: str, proposed: str) -> str:
    return f"Check: {question} Proposed: {proposed}"


async def solve_and_check(base_url: str, session_id: str, sample) -> dict[str, float]:
    question = sample.prompt  # the raw prompt text (the run does not pass --apply-chat-template)
    solver = openai.AsyncOpenAI(base_url=base_url, api_key=f"{session_id}/solver", max_retries=0)
    checker = openai.AsyncOpenAI(base_url=base_url, api_key=f"{session_id}/checker", max_retries=0)
    async with solver, checker:
        proposed = await solver.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": question}])
        proposed_text = proposed.choices[0].message.content or ""  # None: an empty answer
        final = await checker.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": checker_prompt(question, proposed_text)}])
    final_text = final.choices[0].message.content or ""
    return {"solver": math_verify_reward(proposed_text, sample.label),
            "checker": math_verify_reward(final_text, sample.label)}


generate = agent_generate(solve_and_check)
