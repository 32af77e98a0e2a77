"""vLLM 0.32's sampler ranks each returned log-prob with `batched_count_greater_than`, a comparison and a sum that
it compiles with torch.compile (inductor). On CPU inductor builds C++ for it at an engine's first log-prob request:
measured here 2.5 s with a warm inductor cache and 14 s cold, in every engine start and every restarted engine,
ahead of the first rollout or weight check. vime asks for log-probs on every request, so every engine paid it.

`patch_rank_count` makes CPU engines count eagerly, in row chunks so that the comparison's boolean copy stays
small (what the compilation avoids on GPUs); the counts are the same integers.

`patch_spec_expand` mends speculative decoding's sampling on CPU. The rejection sampler spreads each request's
temperature, top-k and top-p over its draft tokens with `expand_batch_to_tokens`, whose CPU kernel
(`cpu_triton_utils._expand_kernel_impl`) casts its output to int64 first: for a float tensor that is a copy, the
kernel writes into the copy, and the temperatures the sampler divides by are uninitialised memory (seen: 1e-30 and
1e20). The draft tokens were then accepted against a distribution that was not the model's, and their returned
log-probs were 0 or NaN. The replacement spreads the values with `repeat_interleave`.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # booleans compared at a time: 16 MB


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of `x` [batch, n]: how many elements are >= that row's value in `values` [batch, 1]."""
    rows = max(1, CHUNK_ELEMENTS // max(1, x.shape[-1]))
    if x.shape[0] <= rows:
        return (x >= values).sum(-1)
    return torch.cat([(x[i:i + rows] >= values[i:i + rows]).sum(-1) for i in range(0, x.shape[0], rows)])


def _patch_cpu(module_name: str, attribute: str, replacement) -> bool:
    """Set `attribute` of vLLM's module `module_name` to `replacement` on the CPU platform; False where vLLM or
    the attribute is not there (another vLLM layout: nothing to mend)."""
    import importlib

    try:
        from vllm.platforms import current_platform

        module = importlib.import_module(module_name)
    except ImportError:
        return False
    if not current_platform.is_cpu() or not hasattr(module, attribute):
        return False
    setattr(module, attribute, replacement)
    return True


def patch_rank_count() -> bool:
    """Replace the sampler's compiled count (CPU platform only); False where there is nothing to patch."""
    return _patch_cpu("vllm.v1.sample.sampler", "batched_count_greater_than", count_at_least)


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0,
                           replace_to=0) -> torch.Tensor:
    """Request i's value of `x` [batch] repeated for each of its tokens (`cu_num_tokens`: cumulative counts),
    `replace_from` read as `replace_to`: [num_tokens]."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def patch_spec_expand() -> bool:
    """Replace the rejection sampler's expansion (CPU platform only); False where there is nothing to patch."""
    return _patch_cpu("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens", expand_batch_to_tokens)
