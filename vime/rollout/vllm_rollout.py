"""The default rollout: async generation through vllm-router, rewards, dynamic sampling.

Hook signatures match slime's, so users' functions port unchanged:
- rollout function: `generate_rollout(args, rollout_id, data_source, evaluation=False)`
  -> list[list[Sample]] (train) or {eval_name: list[Sample]} (evaluation)
- generate function: `async generate(args, sample, sampling_params) -> Sample`
- reward function: `async reward(args, sample) -> float | dict` (`--group-rm`: list in, list out)
- dynamic sampling filter: `filter(args, group) -> DynamicFilterOutput`

The generate function and what it uses (`GenerateState`, `post_generate`, `append_choice`) are `generation.py`'s;
`GenerateState` and `generate` are used here too, so slime's paths to them stay (`vime.rollout.vllm_rollout.generate`
is the default generate function).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from vime.algorithms.names import REMAX_GREEDY_REWARD_KEY
from vime.config.algorithm import AlgorithmConfig
from vime.config.rollout import FaultToleranceConfig, RewardConfig, RolloutConfig
from vime.config.train import RoutingReplayConfig
from vime.engine.control.generate_request import EngineRejectedError, EngineUnavailableError
from vime.rollout.context import rollout_context
from vime.rollout.generation import (GenerateState, append_choice, generate, post_generate_choices, sampling_params_for,
                                     served_model)
from vime.data.sample import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample
from vime.rollout.rm_hub import RewardTypeError, async_rm, batched_async_rm
from vime.rollout.rm_hub.remote_rm import NonFiniteRewardError
from vime.utils.misc import load_function

logger = logging.getLogger(__name__)


def fail_sample(sample: Sample, stage: str, reason: str, error: BaseException | str) -> Sample:
    """Mark `sample` failed: `metadata["failure"] = {stage, reason, error}`; none of its tokens is trained."""
    sample.status = Sample.Status.FAILED
    sample.metadata["failure"] = {"stage": stage, "reason": reason, "error": str(error)[:2000]}
    sample.loss_mask = [0] * sample.response_length
    return sample


def _generate_failure_reason(error: BaseException) -> str:
    if isinstance(error, EngineRejectedError):
        return "engine_rejected"
    if isinstance(error, EngineUnavailableError):
        return "engine_unavailable"
    return "error"


def fail_non_finite_rewards(args, samples: list[Sample]) -> None:
    """Fail each scored sample whose reward is NaN or inf (stage reward, reason non_finite): one such reward
    would spread through its group's mean and std to every advantage of the group. Its reward becomes None."""
    for sample in samples:
        if sample.status in (Sample.Status.FAILED, Sample.Status.ABORTED) or sample.reward is None:
            continue
        try:
            value = sample.get_reward_value(args)
        except (KeyError, TypeError, ValueError):  # no scalar to check (e.g. no --reward-key): reported where used
            continue
        if not math.isfinite(value):
            fail_sample(sample, "reward", "non_finite",
                        f"reward {sample.reward!r:.200} of sample {sample.index} is not finite; the reward function "
                        "must return a finite number (or raise, to fail the sample)")
            sample.reward = None


def fail_non_finite_log_probs(sample: Sample) -> None:
    """Fail a generated sample whose engine log-probs hold NaN or inf: importance weights and the train/rollout
    log-prob gap are computed from them. They become 0 (the sample is never trained; the trainer refuses a
    sample with non-finite log-probs)."""
    bad = [t for t, lp in enumerate(sample.rollout_log_probs or []) if not math.isfinite(lp)]
    if bad and sample.status not in (Sample.Status.FAILED, Sample.Status.ABORTED):
        fail_sample(sample, "generate", "non_finite_log_probs", f"the engine's log-prob of response token {bad[0]} "
                    f"of sample {sample.index} is {sample.rollout_log_probs[bad[0]]}")
        sample.rollout_log_probs = [lp if math.isfinite(lp) else 0.0 for lp in sample.rollout_log_probs]


async def _reward_one(args, sample: Sample) -> None:
    rewards = RewardConfig.of(args)
    try:
        sample.reward = await asyncio.wait_for(async_rm(args, sample), timeout=rewards.rm_timeout)
    except asyncio.TimeoutError:
        fail_sample(sample, "reward", "timeout", f"reward function exceeded --rm-timeout {rewards.rm_timeout}s")
    except RewardTypeError as e:
        fail_sample(sample, "reward", "bad_return_type", e)
    except NonFiniteRewardError as e:  # a reward server's NaN / Infinity
        fail_sample(sample, "reward", "non_finite", e)
    except Exception as e:  # a user's reward function may raise anything; record it per sample
        fail_sample(sample, "reward", "error", f"{type(e).__name__}: {e}")


def sample_seed(args, sample: Sample) -> int:
    """The sampling seed of a sample's request: from --rollout-seed and the sample's index, so a rollout is
    reproducible whatever order the requests run in."""
    rollout = RolloutConfig.of(args)
    return (rollout.rollout_seed * 1_000_003 + sample.index) % 2**31


async def generate_and_rm(args, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False) -> Sample:
    rollout = RolloutConfig.of(args)
    state = GenerateState(args)
    if sample.status == Sample.Status.COMPLETED or sample.status == Sample.Status.TRUNCATED:
        return sample
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        if sample.status == Sample.Status.ABORTED and sample.response_length:  # partial rollout: continue it
            sample.metadata["partial_rollout_resumed"] = sample.metadata.get("partial_rollout_resumed", 0) + 1
            if rollout.mask_offpolicy_in_partial_rollout:  # those tokens came from older weights
                sample.loss_mask = [0] * sample.response_length
        if evaluation or not sampling_params.get("seed"):
            sampling_params = {**sampling_params, "seed": sample_seed(args, sample)}
        try:
            result = await state.generate_fn(args, sample, sampling_params)
        except Exception as e:  # engine errors and custom generate bugs become per-sample failures
            logger.warning("sample %s: generation failed: %s", sample.index, e)
            return fail_sample(sample, "generate", _generate_failure_reason(e), f"{type(e).__name__}: {e}")
    return await _after_generate(args, sample, result)


async def _after_generate(args, sample: Sample, result) -> Sample:
    """A generated sample's type check, final status and reward (unless the group is scored at once)."""
    rollout = RolloutConfig.of(args)
    rewards = RewardConfig.of(args)
    if not isinstance(result, Sample):
        path = rollout.custom_generate_function_path or "vime.rollout.vllm_rollout.generate"
        return fail_sample(sample, "generate", "bad_return_type",
                           f"--custom-generate-function-path {path} returned {type(result).__name__}, expected "
                           f"Sample: {result!r}"[:500])
    if result.status == Sample.Status.PENDING:
        result.status = Sample.Status.COMPLETED
    fail_non_finite_log_probs(result)
    if result.status in (Sample.Status.ABORTED, Sample.Status.FAILED) or rewards.group_rm:
        return result
    await _reward_one(args, result)
    return result


def _one_request(args, group: list[Sample]) -> bool:
    """Whether a group goes to the engine as one request for all its samples (`n`): vime's own generate, fresh
    samples of one prompt with consecutive indices (each then gets the seed its own request would have had) for
    one served model, and a concurrency limit that holds the group."""
    rollout = RolloutConfig.of(args)
    return (len(group) > 1 and GenerateState(args).generate_fn is generate and len(group) <= rollout.rollout_concurrency
            and all(s.status == Sample.Status.PENDING and not s.response_length and s.tokens == group[0].tokens
                    and s.index == group[0].index + k and served_model(s) == served_model(group[0])
                    for k, s in enumerate(group)))


async def generate_group_and_rm(args, group: list[Sample], sampling_params: dict[str, Any],
                                evaluation: bool = False) -> list[Sample]:
    """A group of fresh samples of one prompt in one request: the engine prefills the prompt once and takes all
    the group's sequences into its batch together (one request per sample arrives spread over time, and the
    engine then runs more, fuller decode steps). Sample k gets the seed its own request would have had."""
    state = GenerateState(args)
    async with state.group_slots(len(group)):
        if state.aborted:
            for s in group:
                s.status = Sample.Status.ABORTED
            return group
        params = dict(sampling_params)
        if evaluation or not params.get("seed"):
            params["seed"] = sample_seed(args, group[0])  # the engine gives sequence k seed + k
        params["n"] = len(group)
        try:
            choices = await post_generate_choices(args, group[0].tokens, params, model=served_model(group[0]))
            for sample, choice in zip(group, choices):
                append_choice(sample, choice, state.tokenizer)
        except Exception as e:
            logger.warning("group %s: generation failed: %s", group[0].group_index, e)
            reason = _generate_failure_reason(e)
            return [fail_sample(s, "generate", reason, f"{type(e).__name__}: {e}") for s in group]
    return list(await asyncio.gather(*(_after_generate(args, s, s) for s in group)))


def greedy_sample(prompt: Sample) -> Sample:
    """A fresh sample of `prompt`'s prompt (its tokens before any response), index, label and metadata: what the
    greedy baseline response of --advantage-estimator remax is generated into."""
    return Sample(group_index=prompt.group_index, index=prompt.index, prompt=prompt.prompt,
                  tokens=list(prompt.tokens[:len(prompt.tokens) - prompt.response_length]), label=prompt.label,
                  metadata=dict(prompt.metadata), tools=prompt.tools, status=Sample.Status.PENDING)


async def remax_greedy_reward(args, sample: Sample, sampling_params: dict[str, Any]) -> float | None:
    """ReMax's baseline (Li et al. 2024): one temperature-0 response to the group's prompt (`sample`, from
    `greedy_sample`) through the run's generate function and engines, scored by the run's reward (--group-rm: as a
    group of one). None when it fails or is cut off by the rollout's abort; the trainer then gives the group
    advantage 0."""
    rewards = RewardConfig.of(args)
    state = GenerateState(args)
    params = {**sampling_params, "temperature": 0.0}
    params.pop("n", None)
    async with state.semaphore:
        if state.aborted:
            return None
        try:
            sample = await state.generate_fn(args, sample, params)
        except Exception as e:  # the group still trains on without a baseline: advantage 0
            logger.warning("group %s: the ReMax greedy response failed: %s", sample.group_index, e)
            return None
    if not isinstance(sample, Sample) or sample.status in (Sample.Status.ABORTED, Sample.Status.FAILED):
        return None
    if rewards.group_rm:
        try:
            sample.reward = (await asyncio.wait_for(batched_async_rm(args, [sample]), timeout=rewards.rm_timeout))[0]
        except Exception as e:
            logger.warning("group %s: the ReMax greedy response's reward failed: %s", sample.group_index, e)
            return None
    else:
        await _reward_one(args, sample)
    if sample.status == Sample.Status.FAILED or sample.reward is None:
        return None
    value = sample.get_reward_value(args)
    return value if math.isfinite(value) else None


async def generate_and_rm_group(args, group: list[Sample], sampling_params: dict[str, Any],
                                evaluation: bool = False) -> list[Sample]:
    algorithm = AlgorithmConfig.of(args)
    rewards_flags = RewardConfig.of(args)
    rollout = RolloutConfig.of(args)
    remax = algorithm.advantage_estimator == "remax" and not evaluation
    # the greedy request runs beside the group's; its sample is taken now, while group[0] holds just the prompt
    baseline = asyncio.ensure_future(remax_greedy_reward(args, greedy_sample(group[0]), sampling_params)) \
        if remax else None
    if _one_request(args, group):
        group = await generate_group_and_rm(args, group, sampling_params, evaluation)
    else:
        group = list(await asyncio.gather(*(generate_and_rm(args, s, sampling_params, evaluation) for s in group)))
    if baseline is not None:  # each sample carries its group's greedy reward to the trainer
        greedy_reward = await baseline
        for s in group:
            s.metadata[REMAX_GREEDY_REWARD_KEY] = greedy_reward
    if rewards_flags.group_rm and all(s.status not in (Sample.Status.ABORTED, Sample.Status.FAILED) for s in group):
        try:
            rewards = await asyncio.wait_for(batched_async_rm(args, group), timeout=rewards_flags.rm_timeout)
            for s, r in zip(group, rewards):
                s.reward = r
        except asyncio.TimeoutError:
            for s in group:
                fail_sample(s, "reward", "timeout",
                            f"group reward function exceeded --rm-timeout {rewards_flags.rm_timeout}s")
        except Exception as e:
            reason = "bad_return_type" if isinstance(e, RewardTypeError) else "error"
            for s in group:
                fail_sample(s, "reward", reason, f"group reward: {type(e).__name__}: {e}")
    fail_non_finite_rewards(args, group)
    if rollout.custom_reward_post_process_path and not evaluation:
        load_function(rollout.custom_reward_post_process_path)(args, group)
        fail_non_finite_rewards(args, group)  # what the post-process made of the rewards
    return group


async def generate_rollout_async(args, rollout_id: int, data_source) -> tuple[list[list[Sample]], dict[str, Any]]:
    """Generate until --rollout-batch-size groups pass the dynamic filter; abort the surplus."""
    rollout = RolloutConfig.of(args)
    fault_tolerance = FaultToleranceConfig.of(args)
    from vime.engine.control import client

    state = GenerateState(args)
    state.aborted = False
    state.max_in_flight, state.retries = state.in_flight, 0
    target = rollout.rollout_batch_size
    params = sampling_params_for(args)
    filter_path = rollout.dynamic_sampling_filter_path
    dynamic_filter = load_function(filter_path) if filter_path else None
    pending: set[asyncio.Task] = set()
    data: list[list[Sample]] = []
    stats = {"dropped_groups": 0, "drop_reasons": {}, "submitted_groups": 0, "aborted_groups": 0}
    rounds = 0
    while len(data) < target:
        if len(data) + len(pending) < target:
            if rounds >= rollout.max_dynamic_sampling_rounds:
                raise RuntimeError(
                    f"rollout {rollout_id}: only {len(data)}/{target} groups passed the dynamic sampling filter "
                    f"after {rounds} rounds of {rollout.over_sampling_batch_size}; loosen the filter or raise "
                    "--max-dynamic-sampling-rounds")
            rounds += 1
            for group in data_source.get_samples(rollout.over_sampling_batch_size):
                pending.add(asyncio.create_task(generate_and_rm_group(args, group, params)))
            stats["submitted_groups"] += rollout.over_sampling_batch_size
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            group = task.result()
            if dynamic_filter is not None and len(data) < target:
                verdict = dynamic_filter(args, group)
                if not hasattr(verdict, "keep"):
                    raise TypeError(f"--dynamic-sampling-filter-path {rollout.dynamic_sampling_filter_path} returned "
                                    f"{type(verdict).__name__} ({verdict!r:.200}), expected a DynamicFilterOutput")
                if not verdict.keep:
                    stats["dropped_groups"] += 1
                    reason = verdict.reason or "filtered"
                    stats["drop_reasons"][reason] = stats["drop_reasons"].get(reason, 0) + 1
                    continue
            if len(data) < target:
                data.append(group)
            else:  # finished after the batch was full: served first next rollout (no generation is wasted)
                data_source.add_samples([group])

    if pending:
        state.aborted = True
        context = rollout_context()
        engines = list(context.engine_urls)
        if fault_tolerance.use_fault_tolerance:  # an engine may be dead: it has nothing left to abort
            for url, error in client.post_each(context.token, engines, "/abort_requests", body={})[1].items():
                logger.warning("abort on %s failed: %s", url, error)
        else:
            client.abort_all(context.token, engines)
        leftovers = await asyncio.gather(*pending)
        stats["aborted_groups"] = len(leftovers)
        if rollout.partial_rollout:  # continue the cut-off groups first next rollout
            data_source.add_samples(list(leftovers))
        state.aborted = False
    data.sort(key=lambda g: g[0].index)
    stats["max_in_flight"], stats["request_retries"] = state.max_in_flight, state.retries
    return data, stats


async def eval_rollout_async(args, rollout_id: int, eval_sources: dict[str, Any]) -> dict[str, list[Sample]]:
    params = sampling_params_for(args, evaluation=True)
    results = {}
    for name, source in eval_sources.items():
        groups = source.get_samples(len(source.prompts))
        done = await asyncio.gather(*(generate_and_rm_group(args, g, params, evaluation=True) for g in groups))
        results[name] = [s for g in done for s in g]
    return results


def generate_rollout(args, rollout_id: int, data_source,
                     evaluation: bool = False) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Sync entry called by the rollout manager (slime's signature). Training metrics beyond the samples':
    rollout/{submitted,dropped,aborted}_groups, rollout/dropped/<filter reason>, rollout/max_in_flight (requests
    in flight at once, all engines) and rollout/request_retries."""
    routing_replay = RoutingReplayConfig.of(args)
    from vime.utils.async_utils import run

    if evaluation:
        return RolloutFnEvalOutput(run(eval_rollout_async(args, rollout_id, data_source)))
    groups, stats = run(generate_rollout_async(args, rollout_id, data_source))
    if routing_replay.use_rollout_routing_replay:
        check_routed_experts(groups)
    metrics = {f"rollout/{key}": float(stats[key]) for key in
               ("submitted_groups", "dropped_groups", "aborted_groups", "max_in_flight", "request_retries")}
    metrics.update({f"rollout/dropped/{reason}": float(n) for reason, n in stats["drop_reasons"].items()})
    return RolloutFnTrainOutput(groups, metrics)


def check_routed_experts(groups: list[list[Sample]]) -> None:
    """--use-rollout-routing-replay: every generated sample carries the engine's routing, else a clear error."""
    for sample in (s for g in groups for s in g):
        if sample.status in (Sample.Status.FAILED, Sample.Status.ABORTED) or not sample.response_length:
            continue
        if sample.rollout_routed_experts is None:
            raise RuntimeError(
                f"--use-rollout-routing-replay: the engine returned no routed experts for sample {sample.index}. "
                "Engines vime starts return them; an external engine (--rollout-external-engine-addrs) must run "
                "with --enable-return-routed-experts (vLLM's V2 model runner, VLLM_USE_V2_MODEL_RUNNER=1, a GPU), "
                "and a custom generate function must keep the `routed_experts` of the engine's answer "
                "(vime.rollout.generation.append_choice does)")
