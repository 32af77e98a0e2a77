"""Rollout overhead: the same generate requests sent (a) straight to one vLLM engine and (b) through vime's
rollout function and vllm-router in front of that engine. Prints tokens/s of each and the ratio b/a.

    .venv/bin/python bench/rollout_overhead.py [--prompts 64 --samples 4 --max-tokens 96 --repeats 2]

Both paths use identical sampling parameters and per-request seeds, so they generate the same tokens; the
runs alternate (a, b, a, b, ...) so that drift in machine load hits both alike. Target: b/a >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_args(model: Path, data: Path, out: Path, a) -> argparse.Namespace:
    from vime.arguments import parse_args

    return parse_args([
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label", "--apply-chat-template",
        "--rm-type", "exact_match", "--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt",
        str(a.samples), "--rollout-max-response-len", str(a.max_tokens), "--rollout-concurrency", str(a.concurrency),
        "--rollout-num-gpus", "1", "--output-dir", str(out), "--vllm-dtype", "float32",
        "--vllm-max-model-len", "1024",
    ])


async def raw_rollout(args, engine_url: str, groups, token) -> int:
    """What a hand-written client would do: one POST per sample straight to the engine (with `token`'s key)."""
    from vime.rollout.generation import sampling_params_for

    params = sampling_params_for(args)
    sem = asyncio.Semaphore(args.rollout_concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(sample) -> int:
            p = {**params, "seed": (args.rollout_seed * 1_000_003 + sample.index) % 2**31}
            async with sem, session.post(engine_url + "/inference/v1/generate", headers=token.serving_headers(),
                                         json={"token_ids": sample.tokens, "sampling_params": p}) as r:
                body = await r.json()
            return len(body["choices"][0]["token_ids"])

        counts = await asyncio.gather(*(one(s) for g in groups for s in g))
    return sum(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    a = p.parse_args()

    from vime.engine.control.arguments import router_args_from
    from vime.engine.control.engine import VLLMEngine
    from vime.engine.control.router import Router
    from vime.data.data_source import RolloutDataSource
    from vime.data.prompt_dataset import load_prompt_samples
    from vime.rollout.context import reset_rollout_context
    from vime.rollout.vllm_rollout import GenerateState, generate_rollout_async
    from vime.synthetic.arithmetic_data import write_arithmetic_data
    from vime.synthetic.tiny_model import build_tiny_model
    from vime.utils.async_utils import run
    from vime.utils.auth import RunToken
    from vime.utils.misc import find_free_port

    work = Path(tempfile.mkdtemp(prefix="vime_bench_"))
    model = build_tiny_model(work / "model", arch="qwen3", hidden_size=a.hidden_size, num_layers=a.num_layers,
                             intermediate_size=4 * a.hidden_size, num_heads=a.hidden_size // 64, num_kv_heads=2)
    train, _ = write_arithmetic_data(work / "data", n_train=a.prompts, n_eval=8)
    args = build_args(model, train, work / "out", a)
    token = RunToken.new()
    engine = VLLMEngine(args, 0, str(work / "logs"), token)
    router = None
    try:
        engine_url = engine.start()
        port = find_free_port()
        router = Router(router_args_from(args, "127.0.0.1", port, [engine_url]), str(work / "logs"), token)
        # what the manager sets up
        reset_rollout_context(router_url=router.start(), engine_urls=[engine_url], token=token)
        tokenizer = GenerateState(args).tokenizer
        prompts = load_prompt_samples(train, tokenizer, args)

        def fresh_groups():
            return RolloutDataSource(prompts, a.samples, seed=0, shuffle=False)

        run(raw_rollout(args, engine_url, fresh_groups().get_samples(8), token))  # warm-up both paths
        run(generate_rollout_async(args, 0, fresh_groups()))
        results = {"raw engine": [], "vime rollout + router": []}
        for _ in range(a.repeats):
            start = time.perf_counter()
            tokens = run(raw_rollout(args, engine_url, fresh_groups().get_samples(a.prompts), token))
            results["raw engine"].append(tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            groups, _ = run(generate_rollout_async(args, 0, fresh_groups()))
            tokens = sum(s.response_length for g in groups for s in g)
            results["vime rollout + router"].append(tokens / (time.perf_counter() - start))
        for name, values in results.items():
            print(f"{name:>24}: {sum(values) / len(values):10.1f} tokens/s  (runs: "
                  f"{', '.join(f'{v:.0f}' for v in values)})")
        ratio = (sum(results["vime rollout + router"]) / sum(results["raw engine"]))
        print(f"{'ratio vime / raw':>24}: {ratio:10.3f}  (target >= 0.9)")
    finally:
        if router is not None:
            router.stop()
        engine.stop()


if __name__ == "__main__":
    main()
