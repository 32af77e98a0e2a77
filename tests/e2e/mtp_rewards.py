"""A reward that makes a random tiny policy nearly deterministic within a few GRPO steps, for the speculative
rollout test: each response token scores its rank along the output layer's first principal direction (0 for the
lowest token, 1 for the highest), averaged over the response. Moving the last hidden state along that one
direction raises the top tokens against all others, which the policy learns fast (`multi_lora_rewards`), so its
distribution moves from near uniform to a few tokens: a drafter that follows it gets its drafts accepted, one that
stays as it was does not."""

from __future__ import annotations

import functools


@functools.cache
def token_scores(checkpoint: str) -> dict[int, float]:
    import torch
    from safetensors import safe_open

    with safe_open(f"{checkpoint}/model.safetensors", framework="pt") as f:
        rows = f.get_tensor("lm_head.weight").float()
    direction = torch.linalg.svd(rows - rows.mean(0), full_matrices=False).Vh[0]
    ranks = (rows @ direction).argsort().argsort().float() / (rows.shape[0] - 1)
    return dict(enumerate(ranks.tolist()))


def toward_one_side(args, sample) -> float:
    scores = token_scores(str(args.hf_checkpoint))
    response = sample.tokens[len(sample.tokens) - sample.response_length:]
    return sum(scores.get(t, 0.0) for t in response) / max(len(response), 1)
