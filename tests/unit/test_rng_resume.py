"""A checkpoint saved on one kind of device and resumed on another: the model-parallel RNG tracker's states are a
CPU generator's (5,056 bytes) on CPU and a CUDA Philox state (16 bytes) on a GPU. Loading the former into the latter
made the next fork (TransformerEngine attention, sequence parallel, MoE) fail with "RNG state is wrong size"; now the
tracker keeps this run's seed, with a warning, and the rest of the saved state (Python, torch) is restored."""

from __future__ import annotations

import logging
import random

import torch

from vime.trainer.megatron import checkpoint
from vime.trainer.megatron.checkpoint import _set_rng_state, compatible_tracker_states


class _Tracker:
    def __init__(self, states):
        self.states = states

    def get_states(self):
        return dict(self.states)

    def set_states(self, states):
        self.states = states


def test_a_cpu_saved_tracker_state_is_not_loaded_into_a_cuda_tracker(monkeypatch, caplog):
    cuda_like = _Tracker({"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)})
    monkeypatch.setattr(checkpoint.tensor_parallel, "get_cuda_rng_tracker", lambda: cuda_like)
    saved = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": {"model-parallel-rng": torch.get_rng_state()}, "cuda": None}  # as a CPU run saves it
    expected = torch.rand(3, generator=torch.Generator().set_state(saved["torch"]))
    caplog.set_level(logging.WARNING)
    _set_rng_state(saved)
    assert cuda_like.states["model-parallel-rng"].numel() == 16  # kept
    assert "saved on another kind of device" in caplog.text
    assert torch.equal(torch.rand(3), expected)  # the torch generator itself is restored


def test_same_device_states_are_restored():
    states = {"model-parallel-rng": torch.get_rng_state()}
    assert compatible_tracker_states(states, {"model-parallel-rng": torch.get_rng_state()})
    assert not compatible_tracker_states(states, {"other": torch.get_rng_state()})
    assert not compatible_tracker_states(states, {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)})


def test_the_local_spec_is_built_even_where_transformer_engine_imports(monkeypatch):
    """TransformerEngine's layer spec has never run in vime's trainer: it is not chosen on a GPU with TE installed."""
    import sys
    import types

    from vime.trainer.megatron import model_provider

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert model_provider.use_transformer_engine() is False
