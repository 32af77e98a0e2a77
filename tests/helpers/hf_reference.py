"""Reference log-probs from a float32 transformers forward (eager attention), the yardstick engine and trainer
log-probs are held to in tests."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(path: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def response_log_probs(model, tokens: list[int], prompt_length: int, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each token after the first `prompt_length`, given the tokens before it; computed
    on the model's device, returned on CPU."""
    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    return logp[prompt_length - 1: len(tokens) - 1].gather(-1, ids[0, prompt_length:, None]).squeeze(-1).cpu()
