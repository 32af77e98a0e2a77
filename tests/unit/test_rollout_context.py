"""The rollout context owns the run's generate state: one per run in a process, refused for another run's flags."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vime.rollout.context import reset_rollout_context, rollout_context
from vime.rollout.vllm_rollout import GenerateState


def _args(checkpoint, concurrency=4):
    return SimpleNamespace(hf_checkpoint=str(checkpoint), rollout_concurrency=concurrency,
                           custom_generate_function_path=None)


def test_generate_state_is_the_runs_and_refuses_another_runs_flags(tiny_qwen3, tmp_path):
    reset_rollout_context()
    try:
        args = _args(tiny_qwen3)
        state = GenerateState(args)
        assert rollout_context().generate_state is state
        assert GenerateState(args) is state
        assert GenerateState(_args(tiny_qwen3)) is state  # an equal copy of the flags (another process's view)
        with pytest.raises(ValueError, match="--rollout-concurrency"):
            GenerateState(_args(tiny_qwen3, concurrency=8))
        with pytest.raises(ValueError, match="--hf-checkpoint"):
            GenerateState(_args(tmp_path))
        reset_rollout_context()  # a new run in this process
        fresh = GenerateState(_args(tiny_qwen3, concurrency=8))
        assert fresh is not state and fresh.semaphore._value == 8
    finally:
        reset_rollout_context()
