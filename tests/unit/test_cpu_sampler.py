"""vime's eager rank count for CPU engines (`vime.engine.in_vllm.cpu_sampler`): the same integers as vLLM's
`batched_count_greater_than`, whole or in row chunks, and what the sampler calls once patched."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


def test_eager_count_equals_vllms_compiled_count_and_the_sampler_uses_it(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from vime.engine.in_vllm import cpu_sampler

    g = torch.Generator().manual_seed(0)
    logprobs = torch.randn(9, 1000, generator=g).log_softmax(-1)
    logprobs[:, ::7] = logprobs[:, :1]  # ties: ">=" counts them
    chosen = logprobs.gather(-1, torch.randint(0, 1000, (9, 1), generator=g))
    # vLLM's own code, uncompiled (compiling it is the 2.5-14 s this module spares engines)
    expected = batched_count_greater_than.__wrapped__(logprobs, chosen)
    assert torch.equal(cpu_sampler.count_at_least(logprobs, chosen), expected)
    monkeypatch.setattr(cpu_sampler, "CHUNK_ELEMENTS", 2500)  # two rows a chunk
    assert torch.equal(cpu_sampler.count_at_least(logprobs, chosen), expected)
    assert expected.min() >= 1 and expected.max() <= 1000

    monkeypatch.setattr(sampler, "batched_count_greater_than", sampler.batched_count_greater_than)  # restored after
    assert cpu_sampler.patch_rank_count() == current_platform.is_cpu()
    if current_platform.is_cpu():
        assert sampler.batched_count_greater_than is cpu_sampler.count_at_least
