"""Plug an own agent loop into RL training without touching vime's code.

    train.py ... --router-policy consistent_hash \
        --custom-generate-function-path vime.agents.harness.generate --agent-function-path my_pkg.agent.run \
        --custom-rm-path vime.agents.harness.agent_reward \
        --rollout-function-path vime.agents.harness.generate_rollout     # only for several roles

The agent is `[async] def run(base_url, session_id, sample)`: it drives the policy with the `openai` client
(`AsyncOpenAI(base_url=base_url, api_key=session_id)`; the session id is the episode's 128-bit token, which the
endpoint accepts only while the episode runs) and returns the episode's reward (a number or a reward
dict), per-agent rewards `{role: reward}`, a final answer string (then the usual reward function scores it) or
None. Each call goes through vime's OpenAI-compatible endpoint (`openai_server.py`), which records the exact
tokens; the harness turns each session into a trainable `Sample`: model tokens are trained (loss mask 1), all
other tokens are context (0).

Several agents cooperating in one episode use one session each, `f"{session_id}/{role}"`. Each role becomes its
own Sample; `generate_rollout` regroups them so that every role forms its own GRPO groups (per-role baselines).
A module can also hand its agent over directly: `generate = agent_generate(run)` and
`--custom-generate-function-path my_pkg.agent.generate`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Awaitable, Callable

from vime.agents.chat_session import ChatSession, trajectory_to_sample
from vime.agents.openai_requests import DEFAULT_MAX_IN_FLIGHT
from vime.agents.openai_server import OpenAIServer
from vime.config.agents import AgentConfig, HarnessConfig
from vime.config.rollout import PromptDataConfig, RolloutConfig
from vime.config.router import RouterConfig
from vime.config.run import JobConfig
from vime.data.sample import RolloutFnTrainOutput, Sample
from vime.rollout.context import rollout_context
from vime.utils.device import serving_host
from vime.utils.misc import load_function

logger = logging.getLogger(__name__)
MAIN_ROLE = "main"
AgentFn = Callable[[str, str, Sample], Any]


def get_server(args) -> OpenAIServer:
    """The run's endpoint, held by its rollout context (which stops it at the run's end), started on first use."""
    router = RouterConfig.of(args)
    rollout = RolloutConfig.of(args)
    job = JobConfig.of(args)
    prompt_data = PromptDataConfig.of(args)
    context = rollout_context()
    with context.lock:
        if context.agent_server is None:
            from vime.rollout.generation import retry_window_s, router_url
            from vime.utils.hf_tokenizer import load_tokenizer

            if router.router_policy != "consistent_hash":
                logger.warning("--router-policy is %r: a session's calls may land on different engines; "
                               "--router-policy consistent_hash keeps each on one engine (prefix cache)",
                               router.router_policy)
            harness = HarnessConfig.of(args)
            defaults = {"max_tokens": rollout.rollout_max_response_len, "temperature": rollout.rollout_temperature,
                        "top_p": rollout.rollout_top_p, "top_k": rollout.rollout_top_k}
            context.agent_server = OpenAIServer(
                router_url(), load_tokenizer(job.hf_checkpoint), context.token,
                template_kwargs=prompt_data.apply_chat_template_kwargs,
                default_sampling=defaults, host=serving_host(args), port=harness.agent_endpoint_port,
                max_request_bytes=int(harness.agent_endpoint_max_request_mb * 2**20),
                request_timeout_s=rollout.rollout_request_timeout, retries=rollout.rollout_request_retries,
                retry_window_s=retry_window_s(args),
                tool_call_format=AgentConfig.of(args).agent_tool_call_format,
                max_in_flight=max_endpoint_calls(rollout.rollout_concurrency)).start()
        return context.agent_server


def max_endpoint_calls(rollout_concurrency: int) -> int:
    """How many calls the endpoint serves at once (503 beyond): episodes run --rollout-concurrency at a time and
    each agent of one makes one call at a time; room for 8 agents an episode, and never under the default."""
    return max(DEFAULT_MAX_IN_FLIGHT, 8 * int(rollout_concurrency))


def role_of(session_id: str) -> str:
    return session_id.split("/", 1)[1] if "/" in session_id else MAIN_ROLE


def forced_sampling(args, sampling_params: dict[str, Any]) -> dict[str, Any]:
    """What the run imposes on every chat call of an episode: the response-length cap and seed, and unless
    --agent-use-request-sampling the rollout temperature/top-p/top-k (the trainer's log-probs use them)."""
    keys = ["max_tokens", "seed", "stop_token_ids"]
    if not HarnessConfig.of(args).agent_use_request_sampling:
        keys += ["temperature", "top_p", "top_k"]
    return {k: sampling_params[k] for k in keys if sampling_params.get(k) is not None}


def session_samples(sample: Sample, sessions: dict[str, ChatSession], tokenizer) -> list[Sample]:
    """One Sample per trajectory of each session, in order of the sessions' first calls. A session whose
    history the agent rewrote has several trajectories; they become roles "ROLE#1", "ROLE#2", ..."""
    out = []
    for session_id, session in sessions.items():
        role = role_of(session_id)
        for k, trajectory in enumerate(session.trajectories):
            name = role if k == 0 else f"{role}#{k}"
            out.append(trajectory_to_sample(trajectory, sample, tokenizer, name, session_id))
    return out


def assign_rewards(samples: list[Sample], result: Any) -> None:
    """Record the agent's result on its samples (read back by `agent_reward`)."""
    roles = {s.metadata["agent_role"] for s in samples}
    if result is None:
        return
    if isinstance(result, str):  # a final answer: the reward function scores it
        for s in samples:
            s.metadata["agent_answer"] = result
        samples[0].response = result
        return
    if isinstance(result, dict) and result and set(result) <= roles | {r.split("#")[0] for r in roles}:
        for s in samples:
            reward = result.get(s.metadata["agent_role"], result.get(s.metadata["agent_role"].split("#")[0]))
            if reward is not None:
                s.metadata["agent_reward"] = reward
        return
    if isinstance(result, (int, float, dict)) and not isinstance(result, bool):
        for s in samples:
            s.metadata["agent_reward"] = float(result) if not isinstance(result, dict) else result
        return
    raise TypeError(f"the agent function returned {type(result).__name__}; return a number, a reward dict, "
                    "{role: reward}, a final answer string or None")


async def run_episode(args, agent_fn: AgentFn, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Run the agent on `sample` and return its first role's Sample; the other roles' Samples ride along in
    metadata["agent_role_samples"] (as dicts) until `generate_rollout` regroups them."""
    from vime.rollout.generation import served_model

    server = get_server(args)
    # the token is unguessable: the agent's credential; the episode's calls go to the sample's adapter
    episode = server.open_episode(forced_sampling(args, sampling_params), served_model(sample))
    try:
        result = await asyncio.wait_for(agent_fn(server.base_url, episode, sample),
                                        timeout=HarnessConfig.of(args).agent_timeout)
    finally:
        sessions = server.close_episode(episode)
    samples = session_samples(sample, sessions, server.tokenizer)
    if not samples:
        raise RuntimeError(f"the agent made no chat call for sample {sample.index}: nothing to train on")
    assign_rewards(samples, result)
    main = next((s for s in samples if s.metadata["agent_role"] == MAIN_ROLE), samples[0])
    others = [s for s in samples if s is not main]
    if others:
        main.metadata["agent_role_samples"] = [s.to_dict() for s in others]
    return main


def _as_async(agent_fn: AgentFn) -> Callable[..., Awaitable[Any]]:
    if inspect.iscoroutinefunction(agent_fn):
        return agent_fn

    async def in_thread(*a):  # a sync agent (the sync openai client) must not block the rollout's loop
        return await asyncio.to_thread(agent_fn, *a)

    return in_thread


def agent_generate(agent_fn: AgentFn):
    """A generate function (`--custom-generate-function-path`) that runs `agent_fn` on each sample."""
    agent = _as_async(agent_fn)

    async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
        return await run_episode(args, agent, sample, sampling_params)

    return generate


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """`--custom-generate-function-path vime.agents.harness.generate`: runs `--agent-function-path`."""
    path = HarnessConfig.of(args).agent_function_path
    if not path:
        raise ValueError("vime.agents.harness.generate needs --agent-function-path pkg.module.fn (the agent), or "
                         "use `generate = agent_generate(fn)` in your module as the generate function")
    return await run_episode(args, _as_async(load_function(path)), sample, sampling_params)


def agent_reward(args, sample: Sample) -> float | dict:
    """`--custom-rm-path vime.agents.harness.agent_reward`: the reward the agent function returned."""
    if "agent_reward" not in sample.metadata:
        raise ValueError(f"sample {sample.index}: the agent function returned no reward for role "
                         f"{sample.metadata.get('agent_role')!r}; return one, or score with --rm-type instead")
    return sample.metadata["agent_reward"]


# ---- several roles per episode -> one GRPO group per role ------------------------------------------------------
def _episode_roles(sample: Sample) -> dict[str, Sample]:
    """{role: Sample} of one episode; {} for an episode that failed before any role finished."""
    if "agent_role" not in sample.metadata:
        return {}
    roles = {sample.metadata["agent_role"]: sample}
    for d in sample.metadata.pop("agent_role_samples", []):
        other = Sample.from_dict(d)
        if other.reward is None and "agent_reward" not in other.metadata:
            other.reward = sample.reward  # one episode reward (e.g. --rm-type) for every role
        elif other.reward is None:
            other.reward = other.metadata["agent_reward"]
        if sample.status in (Sample.Status.FAILED, Sample.Status.ABORTED):
            other.status = sample.status
        roles[other.metadata["agent_role"]] = other
    return roles


def _missing(sample: Sample, role: str) -> Sample:
    """A stand-in for a role that did not run in an episode: failed, so the trainer skips it."""
    prompt_tokens = sample.tokens[: sample.prompt_length]
    return Sample(group_index=sample.group_index, index=sample.index, prompt=sample.prompt, tokens=prompt_tokens,
                  label=sample.label, status=Sample.Status.FAILED, loss_mask=[], rollout_log_probs=[],
                  metadata={**sample.metadata, "agent_role": role,
                            "failure": sample.metadata.get("failure", {"stage": "agent", "error": "role not run"})})


def split_role_groups(groups: list[list[Sample]]) -> list[list[Sample]]:
    """Each group of episodes -> one group per role (same size, same order), roles in order of first use."""
    out = []
    for group in groups:
        episodes = [_episode_roles(s) for s in group]
        roles: list[str] = []
        for ep in episodes:
            roles += [r for r in ep if r not in roles]
        if len(roles) <= 1 and all(episodes):
            out.append([ep[roles[0]] for ep in episodes] if roles else group)
            continue
        for role in roles or [MAIN_ROLE]:
            out.append([ep.get(role) or _missing(s, role) for s, ep in zip(group, episodes)])
    return out


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """`--rollout-function-path vime.agents.harness.generate_rollout`: the default rollout, then one GRPO group
    per role. With R roles a rollout has R x rollout-batch-size x n-samples-per-prompt samples (R optimizer steps
    at the default global batch size). Evaluation keeps one sample (the first role) per episode."""
    from vime.rollout.vllm_rollout import generate_rollout as default_rollout

    result = default_rollout(args, rollout_id, data_source, evaluation=evaluation)
    if evaluation:
        for samples in result.data.values():
            for s in samples:
                s.metadata.pop("agent_role_samples", None)
        return result
    return RolloutFnTrainOutput(split_role_groups(result.samples), result.metrics)
