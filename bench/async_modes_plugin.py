"""The long-tail generate function of bench/async_modes.py (importable with bench/ on PYTHONPATH): vime's default
generate with each response capped at BENCH_SHORT tokens, or 8x that for every tenth sample (by index)."""

from __future__ import annotations

import os

from vime.rollout.vllm_rollout import generate as default_generate


async def generate(args, sample, sampling_params):
    short = int(os.environ.get("BENCH_SHORT", "32"))
    cap = 8 * short if (sample.index or 0) % 10 == 0 else short
    return await default_generate(args, sample, {**sampling_params, "max_tokens": cap})
