"""Function-path plugins of bench/e2e_step.py (importable with bench/ on PYTHONPATH): a fixed reward and the two
workloads' generate functions, which add one vLLM sampling parameter each to vime's default generate."""

from __future__ import annotations

from vime.rollout.vllm_rollout import generate as default_generate

MIN_NEW_TOKENS = 8  # variable-length workload: no response shorter than this


async def reward(args, sample) -> float:
    """A fixed, cheap reward: the share of even token ids in the response (varies within a group)."""
    response = sample.tokens[len(sample.tokens) - sample.response_length:]
    return sum(t % 2 == 0 for t in response) / max(len(response), 1)


async def generate_fixed(args, sample, sampling_params):
    """Every response exactly --rollout-max-response-len tokens: the end-of-sequence token does not stop it."""
    return await default_generate(args, sample, {**sampling_params, "ignore_eos": True})


async def generate_variable(args, sample, sampling_params):
    """Responses end at a --rollout-stop-token-ids token, but not before MIN_NEW_TOKENS tokens."""
    return await default_generate(args, sample, {**sampling_params, "min_tokens": MIN_NEW_TOKENS})
