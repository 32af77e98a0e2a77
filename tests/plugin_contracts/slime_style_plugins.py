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
    # the engine's weight version, as slime's generate records it (vLLM answers spans: {"version", "start", "end"})
    sample.weight_versions = (sample.weight_versions or []) + [span["version"] for span in
                                                               choice.get("weight_versions") or []]
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


# ---- slime's other hooks: each records its call in <output-dir>/hook_calls.jsonl (every process appends) ----------

def _record(args, hook: str, **fields) -> None:
    import json
    import os
    from pathlib import Path

    with open(Path(args.output_dir) / "hook_calls.jsonl", "a") as f:
        f.write(json.dumps({"hook": hook, "pid": os.getpid(), **fields}) + "\n")


class DataSource:
    """--data-source-path: slime's DataSource contract (cls(args), get_samples, add_samples, save, load, len) over
    the --prompt-data file, read by the class itself."""

    def __init__(self, args):
        import json

        self.args = args
        with open(args.prompt_data) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.offset = 0
        self.next_index = 0
        _record(args, "data_source.init", rows=len(self.rows))

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for g in range(num_samples):
            row = self.rows[self.offset % len(self.rows)]
            self.offset += 1
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                group.append(Sample(group_index=self.offset - 1, index=self.next_index, prompt=row["prompt"],
                                    label=row["label"], metadata={"from_slime_data_source": True}))
                self.next_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        _record(self.args, "data_source.add_samples", groups=len(samples))

    def save(self, rollout_id: int) -> None:
        _record(self.args, "data_source.save", rollout_id=rollout_id, offset=self.offset)

    def load(self, rollout_id=None) -> None:
        _record(self.args, "data_source.load", rollout_id=rollout_id)

    def __len__(self) -> int:
        return len(self.rows)


def convert_samples_to_train_data(args, samples: list[Sample]) -> dict:
    """--custom-convert-samples-to-train-data-path: slime's default conversion, with every sample's first response
    token masked out of the loss (what the trainer-side postprocess hook then sees)."""
    _record(args, "convert", samples=len(samples))
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [s.get_reward_value(args) for s in samples],
        "raw_reward": [s.reward for s in samples],
        "truncated": [1 if s.status == Sample.Status.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "loss_masks": [[0] + (s.loss_mask or [1] * s.response_length)[1:] for s in samples],
        "rollout_log_probs": [s.rollout_log_probs for s in samples],
    }


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    _record(args, "log_rollout", rollout_id=rollout_id, samples=len(samples), rollout_time=rollout_time,
            from_data_source=all(s.metadata.get("from_slime_data_source") for s in samples))
    return False  # vime's own rollout metrics are logged as well


def log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool:
    _record(args, "log_eval", rollout_id=rollout_id, sets={name: len(d["rewards"]) for name, d in data.items()},
            samples={name: len(d["samples"]) for name, d in data.items()})
    return True  # logged here: vime skips its own eval metrics


def megatron_init(args) -> None:
    import torch.distributed as dist

    _record(args, "megatron_init", rank=dist.get_rank(), world=dist.get_world_size())


def before_log_prob(args, model, store_prefix: str) -> None:
    _record(args, "before_log_prob", store_prefix=store_prefix, chunks=len(model))


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    _record(args, "before_train_step", rollout_id=rollout_id, step_id=step_id, lr=optimizer.param_groups[0]["lr"],
            scheduler=type(opt_param_scheduler).__name__)


def rollout_data_postprocess(args, rollout_id, rollout_data) -> None:
    masks = rollout_data["loss_masks"]
    _record(args, "postprocess", rollout_id=rollout_id, keys=sorted(rollout_data),
            first_masked=all(float(m[0]) == 0.0 for m in masks),
            advantages=len(rollout_data["advantages"]))
