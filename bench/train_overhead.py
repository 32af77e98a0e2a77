"""Training overhead: one GRPO step through vime's `MegatronTrainer.train` (b) against a bare Megatron
forward + backward + optimizer step on the same batch (a). Prints seconds per step of each and the ratio b/a.

    .venv/bin/python bench/train_overhead.py [--samples 64 --tokens 128 --micro-batch-size 8 --repeats 5 --threads 1]

Both use the model and optimizer of `vime.trainer.megatron.model.setup_model_and_optimizer`, the same
HF weights, the same micro-batches (vime's own split) and Megatron's schedule. (a) has a plain inline
cross-entropy on the response tokens; (b) adds everything vime does per step: samples to tensors, GRPO
advantages, the PPO-clip loss with entropy and train/rollout log-prob metrics, metric reduction. One step per
rollout and no KL, so (b) runs no extra forward pass either. Runs alternate (b, a, b, a, ...) so that drift in
machine load hits both alike; the median and the minimum over repeats are printed. Target: b/a <= 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_groups(num_samples: int, group_size: int, tokens: int, seed: int = 0) -> list[list[dict]]:
    """GRPO groups of Sample dicts: prompts of tokens/4..tokens/2, the rest response, random ids, 0/1 rewards."""
    from vime.data.sample import Sample

    g = torch.Generator().manual_seed(seed)
    groups = []
    for p in range(num_samples // group_size):
        prompt = torch.randint(5, 500, (int(torch.randint(tokens // 4, tokens // 2 + 1, (1,), generator=g)),),
                               generator=g).tolist()
        group = []
        for k in range(group_size):
            n = tokens - len(prompt) + int(torch.randint(-8, 9, (1,), generator=g))
            response = torch.randint(5, 500, (n,), generator=g).tolist()
            group.append(Sample(group_index=p, index=p * group_size + k, tokens=prompt + response,
                                response_length=n, reward=float(k % 2), status=Sample.Status.COMPLETED).to_dict())
        groups.append(group)
    return groups


def bare_step(model, optimizer, samples: list[dict], mbs: list[list[int]]) -> float:
    """Megatron forward + backward + optimizer step with a token-mean cross-entropy on the response tokens."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from vime.trainer.batching import pad_tokens

    total_tokens = sum(s["response_length"] for s in samples)

    def forward_step(iterator, chunk):
        indices = next(iterator)
        tokens, positions = pad_tokens([samples[i]["tokens"] for i in indices])
        mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
        for row, i in enumerate(indices):
            total, resp = len(samples[i]["tokens"]), samples[i]["response_length"]
            mask[row, total - resp - 1: total - 1] = 1.0
        logits = chunk(tokens, positions, attention_mask=None)

        def loss_func(output):
            log_probs = output[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
            # Megatron divides by the micro-batch count; undo it so the step's loss is the global token mean
            loss = -(log_probs * mask).sum() / total_tokens * len(mbs)
            return loss, {"loss": loss.detach()}

        return logits, loss_func

    for m in model:
        m.train()
        m.zero_grad_buffer()
    optimizer.zero_grad()
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mbs), model=model, num_microbatches=len(mbs),
        seq_length=max(len(s["tokens"]) for s in samples), micro_batch_size=1, forward_only=False)
    optimizer.step()
    return float(sum(o["loss"] for o in out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64, help="Samples per step (default: 64).")
    p.add_argument("--group-size", type=int, default=4, help="Samples per prompt (default: 4).")
    p.add_argument("--tokens", type=int, default=128, help="Prompt + response tokens per sample, +-8 (default: 128).")
    p.add_argument("--micro-batch-size", type=int, default=8, help="Samples per micro-batch (default: 8).")
    p.add_argument("--hidden-size", type=int, default=256, help="Model hidden size (default: 256).")
    p.add_argument("--num-layers", type=int, default=4, help="Transformer layers (default: 4).")
    p.add_argument("--vocab-size", type=int, default=512, help="Vocabulary (default: 512).")
    p.add_argument("--repeats", type=int, default=5, help="Timed steps of each, after one warm-up (default: 5).")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads; 1 keeps timings steady on a busy machine (default: torch's choice).")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from vime.trainer.batching import micro_batches
    from vime.trainer.megatron.hf_checkpoint import load_hf_checkpoint_into_model
    from vime.trainer.megatron.model import setup_model_and_optimizer
    from vime.trainer.megatron.parallel import destroy_parallel
    from vime.trainer.trainer import MegatronTrainer
    from vime.synthetic.tiny_model import build_tiny_model
    from vime.arguments import parse_args

    with tempfile.TemporaryDirectory() as tmp:
        hf = build_tiny_model(Path(tmp) / "model", arch="qwen3", seed=0, vocab_size=a.vocab_size,
                              hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=4, num_kv_heads=2,
                              intermediate_size=4 * a.hidden_size)
        args = parse_args([
            "--hf-checkpoint", str(hf), "--debug-train-only", "--load-debug-rollout-data", "unused_{rollout_id}",
            "--rm-type", "math", "--rollout-batch-size", str(a.samples // a.group_size),
            "--n-samples-per-prompt", str(a.group_size), "--micro-batch-size", str(a.micro_batch_size),
            "--lr", "1e-6"])
        groups = make_groups(a.samples, a.group_size, a.tokens)
        samples = [s for g in groups for s in g]
        trainer = MegatronTrainer(args)
        model, optimizer, _ = setup_model_and_optimizer(trainer.args, total_steps=1000)  # the architecture filled in
        load_hf_checkpoint_into_model(model, str(hf))
        optimizer.reload_model_params()
        mbs = micro_batches(list(range(len(samples))), [len(s["tokens"]) for s in samples],
                            micro_batch_size=a.micro_batch_size)
        params = sum(p.numel() for p in model[0].parameters())
        print(f"model: {params / 1e6:.1f}M parameters; batch: {len(samples)} samples, "
              f"{sum(len(s['tokens']) for s in samples)} tokens, {len(mbs)} micro-batches of {a.micro_batch_size}; "
              f"{torch.get_num_threads()} threads")

        times = {"bare": [], "vime": []}
        for repeat in range(a.repeats + 1):  # the first round warms up
            start = time.perf_counter()
            metrics = trainer.train(repeat, groups)
            vime_s = time.perf_counter() - start
            start = time.perf_counter()
            loss = bare_step(model, optimizer, samples, mbs)
            bare_s = time.perf_counter() - start
            if repeat:
                times["vime"].append(vime_s)
                times["bare"].append(bare_s)
            print(f"{'warm-up' if not repeat else f'repeat {repeat}'}: vime {vime_s:.3f} s "
                  f"(loss {metrics['train/loss']:+.4f}), bare {bare_s:.3f} s (loss {loss:.4f})")
        destroy_parallel()

    for name, stat in (("median", statistics.median), ("min", min)):  # min: least disturbed by other load
        vime_s, bare_s = stat(times["vime"]), stat(times["bare"])
        print(f"{name} s/step: bare Megatron {bare_s:.3f}, vime {vime_s:.3f}; ratio vime/bare {vime_s / bare_s:.3f} "
              f"(target <= 1.10)")


if __name__ == "__main__":
    main()
