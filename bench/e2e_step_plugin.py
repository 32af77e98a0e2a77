"""Function-path plugins of bench/e2e_step.py (importable with bench/ on PYTHONPATH): a fixed reward, and the
fixed-length workload's generate function (vime's default generate with the end-of-sequence token ignored)."""

from __future__ import annotations

from vime.rollout.vllm_rollout import generate as default_generate

async def reward(args, sample) -> float:
    """A fixed, cheap reward: the share of even token ids in the response (varies within a group)."""
    response = sample.tokens[len(sample.tokens) - sample.response_length:]
    return sum(t % 2 == 0 for t in response) / max(len(response), 1)


async def generate_fixed(args, sample, sampling_params):
    """Every response exactly --rollout-max-response-len tokens: the end-of-sequence token does not stop it."""
    return await default_generate(args, sample, {**sampling_params, "ignore_eos": True})

