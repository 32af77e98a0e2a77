"""Two rewards that pull one policy in opposite directions, for the multi-LoRA test: the share of response tokens
on the "high" side of the output layer, and the share on the "low" side. The sides split the vocabulary at the
median of each token's output-layer row projected on that layer's first principal direction: moving the last
hidden state along that one direction raises every token of one side against the other, which a few GRPO steps on
a random tiny model can learn (a random split of the vocabulary would take hundreds). Adapters that shared their
weights, or requests served by the other adapter, could not raise both."""

from __future__ import annotations

import functools


@functools.cache
def high_side(checkpoint: str) -> frozenset[int]:
    import torch
    from safetensors import safe_open

    with safe_open(f"{checkpoint}/model.safetensors", framework="pt") as f:
        rows = f.get_tensor("lm_head.weight").float()
    direction = torch.linalg.svd(rows - rows.mean(0), full_matrices=False).Vh[0]
    scores = rows @ direction
    return frozenset(torch.nonzero(scores > scores.median()).flatten().tolist())


def high_share(tokens: list[int], checkpoint: str) -> float:
    high = high_side(str(checkpoint))
    return sum(t in high for t in tokens) / max(len(tokens), 1)


def _response(sample) -> list[int]:
    return sample.tokens[len(sample.tokens) - sample.response_length:]


def high(args, sample) -> float:
    return high_share(_response(sample), args.hf_checkpoint)


def low(args, sample) -> float:
    return 1.0 - high_share(_response(sample), args.hf_checkpoint) if sample.response_length else 0.0
