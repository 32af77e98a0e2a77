"""An agent written with the OpenAI Agents SDK, trained with GRPO: a shop assistant answers "How much does milk
cost?" by calling its `get_price` tool and stating the price it gets back. The shop's price list comes with the
sample and reaches the tool through the SDK's run context; the reward pays only for the asked item's price, looked
up with the tool.

The SDK drives the policy through vime's endpoint with the Responses API (`POST /v1/responses`, what the SDK's
`OpenAIResponsesModel` speaks); vime records the exact tokens of every model turn (the tool call, then the answer
after the tool's output) and trains them.

    --custom-generate-function-path examples.agents_sdk.agent.generate
    --custom-rm-path vime.agents.harness.agent_reward
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Literal, get_args

from agents import (Agent, ModelSettings, OpenAIResponsesModel, RunContextWrapper, RunResult, Runner,
                    ToolCallItem, function_tool, set_tracing_disabled)
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

from vime.agents.harness import agent_generate

logger = logging.getLogger(__name__)
set_tracing_disabled(True)  # the SDK would upload traces to OpenAI; there is no network (and no need)

INSTRUCTIONS = "Look up the price with the tool, then give it."
MAX_TURNS = 3  # a tool call, the answer, one spare turn; an episode that keeps calling tools scores 0


Item = Literal["milk", "bread", "rice", "tea", "eggs", "cheese"]
ITEMS = get_args(Item)


@dataclass
class Shop:
    """The episode's world, handed to the tool by the SDK (`Runner.run(..., context=Shop(...))`)."""

    prices: dict[str, int]


def _no_such_item(ctx: RunContextWrapper[Shop], error: Exception) -> str:
    """What the model reads when its call is invalid (the SDK's default is a long error text)."""
    return "no such item"


# The enum (Literal) keeps the item to one of the shop's; the engine's structured output obeys it too.
@function_tool(failure_error_function=_no_such_item)
def get_price(ctx: RunContextWrapper[Shop], item: Item) -> str:
    """Look up the price of an item."""
    return str(ctx.context.prices[item])


def build_agent(client: AsyncOpenAI, tool_choice: str | None = None) -> Agent[Shop]:
    """The agent as its author would write it; only the model's client points at vime's endpoint.
    tool_choice="required" makes the first reply a call (the SDK resets it once a tool ran)."""
    return Agent[Shop](name="shop assistant", instructions=INSTRUCTIONS, tools=[get_price],
                       model=OpenAIResponsesModel(model="policy", openai_client=client),
                       model_settings=ModelSettings(tool_choice=tool_choice))


def last_number(text: str | None) -> str | None:
    numbers = re.findall(r"\d+", text or "")
    return numbers[-1] if numbers else None


def looked_up(result: RunResult) -> list[str]:
    """The items the episode's get_price calls asked for."""
    items = []
    for item in result.new_items:
        if isinstance(item, ToolCallItem) and getattr(item.raw_item, "name", None) == get_price.name:
            try:
                items.append(json.loads(item.raw_item.arguments).get("item"))
            except (ValueError, AttributeError):
                pass
    return items


def score(result: RunResult, asked: str, label: str) -> float:
    """1 when the agent looked up the asked item and its answer's last number is that item's price: a right
    number without the lookup (a guess, or a price remembered) does not count."""
    return float(asked in looked_up(result) and last_number(result.final_output) == str(label))


async def run(base_url: str, session_id: str, sample, tool_choice: str | None = None) -> float:
    """One episode: the SDK's agent loop on the sample's question; its reward. The run's prompts are the raw
    questions (no --apply-chat-template): the endpoint renders the SDK's requests with the chat template."""
    shop = Shop(prices=dict(sample.metadata["prices"]))
    # max_retries=0: an endpoint error (e.g. an aborted generation) ends the episode instead of re-asking
    async with AsyncOpenAI(base_url=base_url, api_key=session_id, max_retries=0) as client:
        try:
            result = await Runner.run(build_agent(client, tool_choice), input=sample.prompt, context=shop,
                                      max_turns=MAX_TURNS)
        except AgentsException as e:  # the model misbehaved (too many turns, a cut-off reply): reward 0
            logger.debug("agents_sdk episode failed: %s: %s", type(e).__name__, e)
            return 0.0
    return score(result, sample.metadata["item"], sample.label)


async def run_tool_required(base_url: str, session_id: str, sample) -> float:
    """The same agent with tool_choice="required": the endpoint holds its first reply to a JSON call of
    `get_price` (vLLM structured outputs), so even a model that never learned the call format calls the tool."""
    return await run(base_url, session_id, sample, tool_choice="required")


generate = agent_generate(run)
generate_tool_required = agent_generate(run_tool_required)
