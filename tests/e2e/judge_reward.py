"""A reward graded by the run's judge (--judge-checkpoint): the judge reads the question and the policy's answer;
its reply decides the reward (an untrained judge's reply is arbitrary: the parity of its first token). The reply
is kept on the sample for the test to check against the judge's weights."""

from __future__ import annotations

from vime.environments.judge import run_judge


async def reward(args, sample) -> float:
    judge = run_judge()
    reply = await judge.chat([{"role": "user", "content": f"Question: {sample.prompt}\nAnswer: {sample.response}\n"
                                                          "Is the answer correct?"}], max_tokens=4)
    sample.metadata["judge"] = reply
    return float(reply["token_ids"][0] % 2) if reply["token_ids"] else 0.0
