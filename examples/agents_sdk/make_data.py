"""Data for the Agents SDK example: RL questions ("How much does milk cost?", label: the asked item's price, the
shop's price list in `metadata.prices`, which the agent hands its tool) and an SFT warm-up set of whole episodes
as the endpoint renders the SDK's requests.

    python -m examples.agents_sdk.make_data --out DIR      # DIR/{train,eval,sft}.jsonl

An SFT row is the SDK's first request in chat form (the agent's instructions as the system message, the user's
question, the `get_price` tool as the Responses route hands it to the chat template) and the episode after it in
`metadata.conversation`: the tool call, the tool's output, the answer
(`--rollout-function-path vime.agents.multi_turn.sft_generate_rollout --tool-key tools`: model turns trained,
the tool turn masked, laid out token for token as the endpoint records a sampled episode).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

# The shop's prices. Fixed, not drawn per episode: a tiny random-init model learns to read a number off the tool
# turn of these ~330-token prompts only after several hundred SFT steps (see the README), far beyond a warm-up.
PRICES = {"milk": 3, "bread": 5, "rice": 2, "tea": 7, "eggs": 4, "cheese": 9}


def question_row(rng: random.Random) -> dict[str, Any]:
    from examples.agents_sdk.agent import ITEMS

    item = rng.choice(ITEMS)
    return {"prompt": f"How much does {item} cost?", "label": str(PRICES[item]),
            "metadata": {"item": item, "prices": dict(PRICES)}}


def sdk_tools() -> list[dict[str, Any]]:
    """The agent's tools as the endpoint gives them to the chat template: each SDK function tool as the SDK
    sends it to the Responses API, through the route's own translation."""
    from examples.agents_sdk.agent import get_price
    from vime.agents.api.responses_api import chat_tool

    return [chat_tool({"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.params_json_schema, "strict": t.strict_json_schema}) for t in [get_price]]


def first_messages(question: str) -> list[dict[str, str]]:
    """The chat messages of the SDK's first request (instructions -> system message, input -> user message)."""
    from examples.agents_sdk.agent import INSTRUCTIONS

    return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]


def answer(price: int | str) -> str:
    return f"It costs {price}."


def sft_row(row: dict[str, Any], tools: list[dict[str, Any]], looked_up: str | None = None) -> dict[str, Any]:
    """A demonstration: the call for `looked_up` (the asked item unless given), the tool's answer for it, and
    that price stated faithfully."""
    item = looked_up or row["metadata"]["item"]
    price = str(row["metadata"]["prices"][item])
    # the text the template renders for this call (canonical arguments, as the endpoint returns them)
    call = f'<tool_call>{{"name": "get_price", "arguments": {{"item": "{item}"}}}}</tool_call>'
    return {"prompt": first_messages(row["prompt"]), "label": row["label"], "tools": tools,
            "metadata": {"conversation": [{"role": "assistant", "content": call},
                                          {"role": "tool", "content": price},
                                          {"role": "assistant", "content": answer(price)}]}}


def sloppy_demonstration(row: dict[str, Any], tools: list[dict[str, Any]], rng: random.Random,
                         sloppiness: float) -> dict[str, Any]:
    """The warm-up's teacher: the call format always right, but with probability `sloppiness` it looks up an item
    drawn at random instead of the asked one (and reports that item's price). The warmed-up model inherits the
    habit, and GRPO has the gap to close: the reward pays only for the asked item's price, looked up."""
    from examples.agents_sdk.agent import ITEMS

    return sft_row(row, tools, rng.choice(ITEMS) if rng.random() < sloppiness else None)


def write_data(out: str | Path, n_train: int = 512, n_eval: int = 64, n_sft: int = 512,
               seed: int = 0, sloppiness: float = 0.5) -> dict[str, Path]:
    out, rng = Path(out), random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    tools = sdk_tools()
    splits = {"train": [question_row(rng) for _ in range(n_train)],
              "eval": [question_row(rng) for _ in range(n_eval)],
              "sft": [sloppy_demonstration(question_row(rng), tools, rng, sloppiness) for _ in range(n_sft)]}
    paths = {}
    for name, rows in splits.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=512)
    p.add_argument("--eval", type=int, default=64)
    p.add_argument("--sft", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sloppiness", type=float, default=0.5,
                   help="how often the warm-up's teacher looks up a random item instead of the asked one")
    a = p.parse_args()
    print(write_data(a.out, a.train, a.eval, a.sft, a.seed, a.sloppiness))
