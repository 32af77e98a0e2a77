"""Supervised fine-tuning through the same loop: the "rollout" is the reference response from the data.

    train.py --debug-train-only --rollout-function-path vime.rollout.sft_rollout.generate_rollout \
             --loss-type sft_loss --prompt-data sft.jsonl ...

Each row's response is `metadata["response"]` (set with --metadata-key); the EOS token is appended so the
model learns to stop. No engine is involved.
"""

from __future__ import annotations

from vime.config.rollout import RolloutConfig
from vime.config.run import JobConfig
from vime.data.sample import Sample
from vime.utils.hf_tokenizer import shared_tokenizer


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    job = JobConfig.of(args)
    rollout = RolloutConfig.of(args)
    if evaluation:
        raise ValueError("sft_rollout has no evaluation mode; use the default rollout for --eval-function-path")
    tokenizer = shared_tokenizer(job.hf_checkpoint)
    groups = data_source.get_samples(rollout.rollout_batch_size)
    for group in groups:
        for sample in group:
            response = sample.metadata.get("response")
            if not isinstance(response, str):
                raise ValueError(f"sample {sample.index}: SFT needs metadata['response'] (a string); "
                                 f"got {type(response).__name__}")
            ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            sample.tokens = sample.tokens + ids
            sample.response = response
            sample.response_length = len(ids)
            sample.loss_mask = [1] * len(ids)
            sample.reward = 0.0
            sample.status = Sample.Status.COMPLETED
    return groups
