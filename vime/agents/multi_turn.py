"""Multi-turn generation in one token sequence: model turns are trained, tool/environment turns are not.

    --custom-generate-function-path vime.agents.multi_turn.generate

Each episode loops: model turn (token ids and log-probs straight from vLLM, loss_mask 1) -> environment step
(by default: parse tool calls, run the tools) -> environment turn appended as tokens with loss_mask 0 and
log-prob 0 -> next model turn; until the environment has nothing to say, --agent-max-turns model turns, the
token budget (--rollout-max-response-len counts every response token, model and tool alike) or an abort.

No re-tokenization: sampled ids are stored as returned; an environment turn is tokenized alone, from the piece
of chat template it adds (`environment_turn_ids`), so trained tokens are exactly the sampled ones.

A different agent loop or environment needs no change here: pass your own `environment` (or tools) from a
three-line generate function of your own, see `examples/tool_use/` and `examples/coding_agent/`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Awaitable, Callable

from vime.agents.tool_parsing import parse_tool_calls
from vime.agents.tools import TOOLS, Tool, ToolContext, register_tool, run_tool_call, select_tools
from vime.config.agents import AgentConfig
from vime.config.rollout import RolloutConfig
from vime.config.run import JobConfig
from vime.data.sample import Sample
from vime.rollout.generation import GenerateState, append_choice, post_generate, served_model
from vime.utils.misc import load_function

logger = logging.getLogger(__name__)

Environment = Callable[..., Awaitable["list[dict[str, Any]] | None"]]
_MARK = "\u2063VIME_TURN_END\u2063"  # a string no template changes, to cut the template where the model stopped


# ---- token assembly (pure) --------------------------------------------------------------------------------

def environment_turn_ids(tokenizer, messages: list[dict[str, Any]], model_turn_ids: list[int]) -> list[int]:
    """Token ids the chat template adds after a model turn for `messages` (tool/user), up to and including the
    next assistant header.

    The template is rendered for [user, assistant=MARK, *messages] and cut after MARK, so whatever the template
    puts between turns (end-of-turn token, role headers, <tool_response> wrappers) comes out exactly; when the
    model already ended its turn with that end-of-turn token, it is not added twice.
    """
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}, *messages],
        tokenize=False, add_generation_prompt=True)
    cut = rendered.rfind(_MARK)
    if cut < 0:
        raise ValueError("the chat template dropped the assistant content; cannot find the turn boundary")
    delta = rendered[cut + len(_MARK):]
    if model_turn_ids:
        last = tokenizer.decode(model_turn_ids[-1:], skip_special_tokens=False)
        if last and last.strip() and delta.startswith(last):  # the model closed its own turn
            delta = delta[len(last):]
    return tokenizer(delta, add_special_tokens=False)["input_ids"]


def append_environment_turn(sample: Sample, token_ids: list[int]) -> None:
    """Append non-trained tokens (loss_mask 0, log-prob 0.0)."""
    sample.tokens = sample.tokens + list(token_ids)
    sample.response_length += len(token_ids)
    sample.loss_mask = (sample.loss_mask or []) + [0] * len(token_ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [0.0] * len(token_ids)


def conversation_to_tokens(tokenizer, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Response tokens and loss mask for a scripted conversation after the prompt (assistant, tool, assistant,
    ...), laid out exactly as `generate` lays out a sampled one: an assistant turn is its text + EOS, trained;
    everything in between comes from `environment_turn_ids`, masked. Used for multi-turn SFT warm-ups."""
    tokens, mask, last_model_turn = [], [], []
    pending: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant":
            if pending:
                ids = environment_turn_ids(tokenizer, pending, last_model_turn)
                tokens += ids
                mask += [0] * len(ids)
                pending = []
            last_model_turn = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [
                tokenizer.eos_token_id]
            tokens += last_model_turn
            mask += [1] * len(last_model_turn)
        else:
            pending.append(m)
    if pending:
        raise ValueError("a scripted conversation must end with an assistant turn")
    return tokens, mask


# ---- the default environment: tool calls ------------------------------------------------------------------

def _load_tool_paths(args) -> None:
    for path in AgentConfig.of(args).agent_tool_paths or []:
        tool = load_function(path)
        if not isinstance(tool, Tool):
            raise TypeError(f"--agent-tool-paths {path}: expected a vime.agents.tools.Tool, got {type(tool).__name__}")
        if TOOLS.get(tool.name) is not tool:
            register_tool(tool)


def _sandbox(args):
    agent = AgentConfig.of(args)
    return _shared_sandbox(agent.agent_sandbox, agent.agent_sandbox_allow_weak_isolation)


@functools.cache  # one per process and setting: it holds the process's sandbox slots (uids, directories)
def _shared_sandbox(spec: str | None, allow_weak: bool):
    from vime.agents.sandbox import make_sandbox

    return make_sandbox(spec, allow_weak_isolation=allow_weak)


async def tool_environment(args, sample: Sample, model_text: str, turn: int) -> list[dict[str, Any]] | None:
    """Run the tool calls in `model_text`; one tool message per call, None when there is no call (the end)."""
    agent = AgentConfig.of(args)
    calls = parse_tool_calls(model_text, agent.agent_tool_call_format)
    if not calls:
        return None
    _load_tool_paths(args)
    tools = select_tools(sample.tools, agent.agent_tools)
    ctx = ToolContext(args=args, sample=sample, sandbox=_sandbox(args), timeout_s=float(agent.agent_tool_timeout))
    limit = int(agent.agent_max_tool_output_chars)
    messages = []
    for call in calls:  # in order: a later call may depend on an earlier one's side effects
        text = await run_tool_call(call, tools, ctx)
        if len(text) > limit:
            text = text[:limit] + "\n[output truncated]"
        messages.append({"role": "tool", "content": text})
    sample.metadata["tool_calls"] = sample.metadata.get("tool_calls", 0) + len(calls)
    return messages


# ---- the generate function --------------------------------------------------------------------------------

async def generate(args, sample: Sample, sampling_params: dict[str, Any], *, environment: Environment | None = None,
                   max_turns: int | None = None, max_turn_tokens: int | None = None) -> Sample:
    """slime's generate hook, multi-turn. The keyword arguments override the --agent-* flags, for wrappers.

    sample.metadata["turns"] lists the turns: {"role": "assistant"|"environment", "start", "length"} (offsets
    into the response) plus the model turn's "finish_reason"; metadata["stop"] says why the episode ended.
    """
    state = GenerateState(args)
    tokenizer = state.tokenizer
    agent = AgentConfig.of(args)
    environment = environment or load_function(agent.agent_environment_path)
    max_turns = max_turns or int(agent.agent_max_turns)
    max_turn_tokens = max_turn_tokens or agent.agent_max_turn_tokens
    budget = sampling_params["max_tokens"]
    turns: list[dict[str, Any]] = sample.metadata.setdefault("turns", [])
    sample.loss_mask = sample.loss_mask or []
    sample.rollout_log_probs = sample.rollout_log_probs or []
    resuming = bool(turns) and turns[-1]["role"] == "assistant" and turns[-1].get("finish_reason") == "abort"

    while True:
        remaining = budget - sample.response_length
        if remaining <= 0:
            sample.status, sample.metadata["stop"] = Sample.Status.TRUNCATED, "max_tokens"
            return sample
        start = sample.response_length
        turn_cap = min(remaining, max_turn_tokens) if max_turn_tokens else remaining
        choice = await post_generate(args, sample.tokens, {**sampling_params, "max_tokens": turn_cap},
                                     model=served_model(sample))
        append_choice(sample, choice, tokenizer, trainable=True)
        if sample.status == Sample.Status.TRUNCATED and turn_cap < remaining:  # the turn's cap, not the budget
            sample.status = Sample.Status.COMPLETED
        if resuming:  # a partial rollout continues the cut-off model turn
            turn = turns[-1]
            turn["length"] += sample.response_length - start
            resuming = False
        else:
            turn = {"role": "assistant", "start": start, "length": sample.response_length - start}
            turns.append(turn)
        turn["finish_reason"] = choice.get("finish_reason")
        if sample.status in (Sample.Status.ABORTED, Sample.Status.TRUNCATED):
            sample.metadata["stop"] = "abort" if sample.status == Sample.Status.ABORTED else "max_tokens"
            return sample
        if sum(t["role"] == "assistant" for t in turns) >= max_turns:
            sample.metadata["stop"] = "max_turns"
            return sample
        model_ids = sample.response_tokens[turn["start"]:turn["start"] + turn["length"]]
        model_text = tokenizer.decode(model_ids, skip_special_tokens=True)
        messages = await environment(args, sample, model_text, len(turns))
        if not messages:
            sample.metadata["stop"] = "done"
            return sample
        ids = environment_turn_ids(tokenizer, messages, model_ids)
        if sample.response_length + len(ids) >= budget:  # no room left for the model to answer
            sample.status, sample.metadata["stop"] = Sample.Status.TRUNCATED, "max_tokens"
            return sample
        turns.append({"role": "environment", "start": sample.response_length, "length": len(ids)})
        append_environment_turn(sample, ids)


# ---- multi-turn SFT warm-up -------------------------------------------------------------------------------

def sft_generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    """SFT on scripted multi-turn conversations (metadata["conversation"]: assistant/tool messages after the
    prompt), laid out like sampled ones: assistant turns trained, tool turns masked.

        train.py --debug-train-only --loss-type sft_loss --rollout-function-path \\
                 vime.agents.multi_turn.sft_generate_rollout ...
    """
    job = JobConfig.of(args)
    rollout = RolloutConfig.of(args)
    if evaluation:
        raise ValueError("sft_generate_rollout has no evaluation mode")
    from vime.utils.hf_tokenizer import shared_tokenizer

    tokenizer = shared_tokenizer(job.hf_checkpoint)
    groups = data_source.get_samples(rollout.rollout_batch_size)
    for group in groups:
        for sample in group:
            conversation = sample.metadata.get("conversation")
            if not isinstance(conversation, list) or not conversation:
                raise ValueError(f"sample {sample.index}: multi-turn SFT needs metadata['conversation'], a list "
                                 "of {'role', 'content'} messages after the prompt")
            ids, mask = conversation_to_tokens(tokenizer, conversation)
            sample.tokens = sample.tokens + ids
            sample.response_length = len(ids)
            sample.loss_mask = mask
            sample.response = tokenizer.decode(ids, skip_special_tokens=False)
            sample.reward = 0.0
            sample.status = Sample.Status.COMPLETED
    return groups


def model_turn_texts(tokenizer, sample: Sample) -> list[str]:
    """The text of each model turn of a finished episode (special tokens dropped), for reward functions."""
    response = sample.response_tokens
    return [tokenizer.decode(response[t["start"]:t["start"] + t["length"]], skip_special_tokens=True)
            for t in sample.metadata.get("turns", []) if t["role"] == "assistant"]
