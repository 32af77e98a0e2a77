"""Custom functions written as slime's docs and examples write them, under vime's names: a generate function that
posts token ids to the router at `args.vllm_router_ip` / `args.vllm_router_port` with `GenerateState(args)`'s
tokenizer, semaphore and sampling defaults; a reward function that lists the router's workers (slime's abort
helper reads `/workers`, older ones `/list_workers`); a dynamic-sampling filter and a loss that read run-time
values. Each records what it saw in the sample's metadata or the loss's metrics, for
test_slime_plugins_e2e.py to check."""

from __future__ import annotations

import aiohttp

from vime.rollout.filter_hub.dynamic_sampling_filters import DynamicFilterOutput
from vime.rollout.vllm_rollout import GenerateState
from vime.utils.types import Sample


async def _get(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
            response.raise_for_status()
            return await response.json()


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.vllm_router_ip}:{args.vllm_router_port}/inference/v1/generate"
    if not sample.tokens:
        sample.tokens = state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    params = {**state.sampling_params, **sampling_params, "logprobs": 0}
    params["max_tokens"] -= sample.response_length
    payload = {"token_ids": sample.tokens, "sampling_params": params}
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=120)) as response:
            response.raise_for_status()
            output = await response.json()
    choice = output["choices"][0]
    new_tokens = choice["token_ids"]
    sample.tokens = sample.tokens + new_tokens
    sample.response_length += len(new_tokens)
    sample.response = (sample.response or "") + state.tokenizer.decode(new_tokens)
    sample.loss_mask = (sample.loss_mask or []) + [1] * len(new_tokens)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [t["logprob"] for t in choice["logprobs"]["content"]]
    sample.status = Sample.Status.TRUNCATED if choice["finish_reason"] == "length" else Sample.Status.COMPLETED
    sample.metadata["seen_by_generate"] = {
        "router": [args.vllm_router_ip, args.vllm_router_port],
        "slime_router": [args.sglang_router_ip, args.sglang_router_port],
        "engines": args.rollout_num_engines, "max_tokens": state.sampling_params["max_tokens"],
    }
    return sample


async def reward(args, sample: Sample) -> float:
    base = f"http://{args.vllm_router_ip}:{args.vllm_router_port}"
    workers = [w["url"] for w in (await _get(base + "/workers"))["workers"]]
    legacy = (await _get(base + "/list_workers"))["urls"]
    sample.metadata["seen_by_reward"] = {"workers": workers, "list_workers": legacy}
    return float(len(workers) == args.rollout_num_engines) * (sample.response_length % 3) / 2


def keep_all(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    for sample in samples:
        sample.metadata["seen_by_filter"] = {"num_rollout": args.num_rollout, "router_port": args.vllm_router_port,
                                             "sglang_server_concurrency": args.sglang_server_concurrency}
    return DynamicFilterOutput(keep=True)


def loss(args, micro_batch, log_probs, entropy, aggregate):
    """REINFORCE on the advantages, reporting the router port the trainer's view holds."""
    import torch

    terms = [-lp * adv.to(lp.device) for lp, adv in zip(log_probs, micro_batch["advantages"])]
    value = aggregate(terms, micro_batch["loss_masks"])
    return value, {"plugin_router_port": torch.tensor(float(args.vllm_router_port or -1))}
