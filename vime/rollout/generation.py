"""Generation through vllm-router, what every generate function uses: the run's `GenerateState` (tokenizer, HTTP
session, concurrency limit, counters), token-in/token-out requests with retries, an engine answer appended to a
sample, and vime's default generate function (slime's signature: `async generate(args, sample, sampling_params)`).
The rollout around them (groups, rewards, dynamic sampling) is `vllm_rollout.py`, where slime's users find these
names too.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

from vime.config.rollout import EvalConfig, FaultToleranceConfig, RolloutConfig
from vime.config.run import JobConfig
from vime.data.sample import ADAPTER_KEY, Sample
from vime.data.weight_versions import add_spans, add_versions
from vime.engine.control.client import SERVED_MODEL
from vime.engine.control.generate_request import decode_routed_experts, request_choices
from vime.rollout.context import rollout_context
from vime.utils.misc import load_function

_FINISH_STATUS = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED}


class GenerateState:
    """The run's state shared by all generate calls: tokenizer, HTTP session, concurrency limit, counters.

    `GenerateState(args)` (slime's spelling, kept for custom generate functions) returns the one held by this
    process's rollout context, made from `args` by the first call; a new run (`reset_rollout_context()`) or
    `GenerateState.reset()` starts a fresh one. A call with flags that would need another state (another
    checkpoint, concurrency or generate function) is refused rather than silently given the old one.

    What slime's generate functions read from it: `tokenizer`, `processor` (None: text models), `semaphore` (the
    run's --rollout-concurrency over all engines), `sampling_params` (the --rollout-* defaults, in vLLM's names:
    `max_tokens` where slime's SGLang says `max_new_tokens`) and `aborted`.
    """

    @staticmethod
    def _identity(args) -> dict:
        """The flags a generate state is made for: another value needs another state."""
        rollout = RolloutConfig.of(args)
        return {"hf_checkpoint": JobConfig.of(args).hf_checkpoint, "rollout_concurrency": rollout.rollout_concurrency,
                "custom_generate_function_path": rollout.custom_generate_function_path}

    def __new__(cls, args):
        context = rollout_context()
        state = context.generate_state
        if state is None:
            state = super().__new__(cls)
            state._init(args)
            context.generate_state = state
        elif state.args is not args:
            before, now = cls._identity(state.args), cls._identity(args)
            changed = [k for k in before if before[k] != now[k]]
            if changed:
                key = changed[0]
                raise ValueError(f"GenerateState: this process's generate state was made for another "
                                 f"--{key.replace('_', '-')} ({before[key]!r}, now {now[key]!r}); call "
                                 "GenerateState.reset() (or vime.rollout.context.reset_rollout_context()) before "
                                 "another run in this process")
        return state

    def _init(self, args) -> None:
        job = JobConfig.of(args)
        rollout = RolloutConfig.of(args)
        from vime.utils.hf_tokenizer import load_tokenizer

        self.args = args
        self.tokenizer = load_tokenizer(job.hf_checkpoint)
        self.processor = None  # slime's multimodal processor: vime's models are text-only
        self.semaphore = asyncio.Semaphore(rollout.rollout_concurrency)
        self._group_lock = asyncio.Lock()
        self.session: aiohttp.ClientSession | None = None
        self.aborted = False  # set when the batch is full: queued requests return without being sent
        self.in_flight = 0  # generate requests sent and not yet answered (all engines)
        self.max_in_flight = 0  # its peak since the last rollout started
        self.retries = 0  # generate requests sent again after an error or a timeout, since the rollout started
        custom = rollout.custom_generate_function_path
        self.generate_fn = load_function(custom) if custom else generate

    @property
    def sampling_params(self) -> dict[str, Any]:
        """The --rollout-* sampling defaults (a fresh dict each time: callers change theirs)."""
        return sampling_params_for(self.args)

    @contextlib.asynccontextmanager
    async def group_slots(self, count: int):
        """Hold `count` slots of the concurrency limit at once (a group sent as one request). Taken under a lock,
        so that two groups never each hold part of what both need."""
        async with self._group_lock:
            for _ in range(count):
                await self.semaphore.acquire()
        try:
            yield
        finally:
            for _ in range(count):
                self.semaphore.release()

    def http(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            self.session = aiohttp.ClientSession(connector=connector)
        return self.session

    @classmethod
    def reset(cls) -> None:
        rollout_context().generate_state = None


def router_url() -> str:
    """The router every generate request goes through (the rollout manager started or registered with it)."""
    url = rollout_context().router_url
    if url is None:
        raise RuntimeError("no router in this process's rollout context: generate runs in the rollout manager, "
                           "after it started the engines")
    return url


def sampling_params_for(args, evaluation: bool = False) -> dict[str, Any]:
    """vLLM sampling parameters from the --rollout-* (or --eval-*) flags."""
    evaluation_flags = EvalConfig.of(args)
    rollout = RolloutConfig.of(args)
    p = dict(
        temperature=evaluation_flags.eval_temperature if evaluation else rollout.rollout_temperature,
        top_p=evaluation_flags.eval_top_p if evaluation else rollout.rollout_top_p,
        top_k=evaluation_flags.eval_top_k if evaluation else rollout.rollout_top_k,
        max_tokens=evaluation_flags.eval_max_response_len if evaluation else rollout.rollout_max_response_len,
        logprobs=0,  # the sampled token's own log-prob
        skip_special_tokens=False,
    )
    if rollout.rollout_stop:
        p["stop"] = list(rollout.rollout_stop)
    if rollout.rollout_stop_token_ids:
        p["stop_token_ids"] = list(rollout.rollout_stop_token_ids)
    return p


def retry_window_s(args) -> float:
    """How long retries of one request keep going at least. With --use-fault-tolerance the router may still
    send requests to a dead engine until the health monitor takes it out, so retries must outlast that."""
    fault_tolerance = FaultToleranceConfig.of(args)
    if not fault_tolerance.use_fault_tolerance:
        return 0.0
    return fault_tolerance.rollout_health_check_interval + fault_tolerance.rollout_health_check_timeout + 10.0


def served_model(sample: Sample) -> str:
    """The model a sample's requests ask the engines for: its adapter's name in a multi-LoRA run
    (`metadata[ADAPTER_KEY]`), else the policy."""
    return sample.metadata.get(ADAPTER_KEY) or SERVED_MODEL


async def post_generate(args, token_ids: list[int], sampling_params: dict[str, Any], *,
                        model: str = SERVED_MODEL) -> dict[str, Any]:
    """One token-in/token-out request through the router, with retries (`request_choices`: at least
    --rollout-request-retries times, and for `retry_window_s` with fault tolerance). Returns the first choice.
    `model`: the served model asked for, `served_model(sample)` for a sample's request."""
    return (await post_generate_choices(args, token_ids, sampling_params, model=model))[0]


async def post_generate_choices(args, token_ids: list[int], sampling_params: dict[str, Any], *,
                                model: str = SERVED_MODEL) -> list[dict[str, Any]]:
    """Like `post_generate`, for every choice: `sampling_params["n"]` sequences from one prompt, one request."""
    rollout = RolloutConfig.of(args)
    state = GenerateState(args)
    payload = {"token_ids": token_ids, "sampling_params": sampling_params, "model": model}
    return await request_choices(state.http(), router_url(), payload, token=rollout_context().token,
                                 timeout=aiohttp.ClientTimeout(total=rollout.rollout_request_timeout),
                                 retries=rollout.rollout_request_retries, retry_window_s=retry_window_s(args),
                                 counters=state)


def append_choice(sample: Sample, choice: dict[str, Any], tokenizer, trainable: bool = True) -> None:
    """Append a generate answer (token ids, log-probs, weight versions, finish reason) to `sample`. The routed
    experts an engine returns (--use-rollout-routing-replay) cover the request's whole prompt, so they replace
    the sample's."""
    new_tokens = choice.get("token_ids") or []
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(new_tokens):
        raise RuntimeError(f"engine returned {len(new_tokens)} tokens but {len(content)} log-probs")
    add_spans(sample.weight_version_spans, choice.get("weight_versions"), sample.response_length, len(new_tokens))
    add_versions(sample.weight_versions, choice.get("weight_versions"))
    sample.tokens = sample.tokens + new_tokens
    sample.response_length += len(new_tokens)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [c["logprob"] for c in content]
    sample.loss_mask = (sample.loss_mask or []) + [int(trainable)] * len(new_tokens)
    if choice.get("routed_experts") is not None:
        sample.rollout_routed_experts = decode_routed_experts(choice["routed_experts"])
    sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=False)
    sample.status = _FINISH_STATUS.get(choice.get("finish_reason"), Sample.Status.COMPLETED)


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Default single-turn generation; continues a partially generated sample where it stopped."""
    state = GenerateState(args)
    params = dict(sampling_params)
    params["max_tokens"] = params["max_tokens"] - sample.response_length
    if params["max_tokens"] <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    choice = await post_generate(args, sample.tokens, params, model=served_model(sample))
    append_choice(sample, choice, state.tokenizer)
    return sample
