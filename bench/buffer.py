"""Data buffer throughput: samples pushed by a producer process (a Ray actor, like the rollout manager) and
pulled by the driver, through the object-store and the straw transports, side by side.

    .venv/bin/python bench/buffer.py [--samples 10000 --tokens 1024 --per-rollout 1000 --dir /tmp/x]

Each sample has `--tokens` tokens (half prompt, half response) with a log-prob and a loss-mask entry per response
token, as the rollout manager hands them over. Push = encode + put in the producer, pull = get + decode in the
driver, one rollout of `--per-rollout` samples at a time; MB/s counts the encoded bytes (MB = 10^6 bytes).
straw writes to `--dir` (default: a temporary directory under /tmp) and every put is durable when it returns.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_rollout(rollout_id: int, n: int, tokens: int) -> list[list[dict]]:
    from vime.data.sample import Sample

    rng = random.Random(rollout_id)
    response = tokens // 2
    samples = [Sample(group_index=rollout_id, index=rollout_id * n + i, prompt="bench",
                      tokens=[rng.randrange(150_000) for _ in range(tokens)], response_length=response,
                      loss_mask=[1] * response, rollout_log_probs=[-rng.random() for _ in range(response)],
                      reward=rng.random(), status=Sample.Status.COMPLETED).to_dict() for i in range(n)]
    return [samples[i:i + 8] for i in range(0, n, 8)]  # groups of 8


class Producer:
    """Builds the rollouts ahead of time (not timed), then pushes them through a transport when asked."""

    def __init__(self, data_buffer, num_rollouts: int, per_rollout: int, tokens: int):
        from vime.transport.rollouts import make_transport

        self.transport = make_transport(data_buffer)
        self.rollouts = [make_rollout(i, per_rollout, tokens) for i in range(num_rollouts)]

    def push(self) -> tuple[list, float, int]:
        from vime.data.sample_codec import encode_rollout

        nbytes = sum(len(encode_rollout(r, {"rollout_id": i})) for i, r in enumerate(self.rollouts))  # not timed
        start = time.perf_counter()
        handles = [self.transport.put(i, r, {"rollout_id": i}) for i, r in enumerate(self.rollouts)]
        return handles, time.perf_counter() - start, nbytes

    def close(self) -> None:
        self.transport.close()


def bench(data_buffer, a) -> dict[str, float]:
    import ray

    from vime.transport.rollouts import make_transport

    num_rollouts = a.samples // a.per_rollout
    producer = ray.remote(Producer).options(num_cpus=0).remote(data_buffer, num_rollouts, a.per_rollout, a.tokens)
    handles, push_s, nbytes = ray.get(producer.push.remote())
    consumer = make_transport(data_buffer)
    start = time.perf_counter()
    pulled = sum(len(g) for h in handles for g in consumer.get(h)[0])
    pull_s = time.perf_counter() - start
    consumer.close()
    ray.get(producer.close.remote())
    ray.kill(producer)
    n = num_rollouts * a.per_rollout
    assert pulled == n, (pulled, n)
    return {"push_samples_s": n / push_s, "push_mb_s": nbytes / push_s / 1e6, "pull_samples_s": n / pull_s,
            "pull_mb_s": nbytes / pull_s / 1e6, "mb": nbytes / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10_000)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per sample (default: 1024)")
    p.add_argument("--per-rollout", type=int, default=1000, help="samples per put/get (default: 1000)")
    p.add_argument("--dir", default=None, help="straw directory (default: a fresh one under /tmp, removed after)")
    a = p.parse_args()
    import ray

    from vime.config.rollout import DataBufferConfig

    straw_dir = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="vime-buffer-bench-"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        results = {
            "object-store": bench(DataBufferConfig(rollout_data_transport="object-store"), a),
            "straw": bench(DataBufferConfig(rollout_data_transport="straw", rollout_data_dir=str(straw_dir)), a),
        }
    finally:
        ray.shutdown()
        if not a.dir:
            shutil.rmtree(straw_dir, ignore_errors=True)
    mb = results["straw"]["mb"]
    print(f"{a.samples} samples x {a.tokens} tokens ({mb:.1f} MB encoded), {a.per_rollout} samples per rollout")
    print(f"{'transport':>14} {'push samples/s':>15} {'push MB/s':>10} {'pull samples/s':>15} {'pull MB/s':>10}")
    for name, r in results.items():
        print(f"{name:>14} {r['push_samples_s']:15.0f} {r['push_mb_s']:10.1f} {r['pull_samples_s']:15.0f} "
              f"{r['pull_mb_s']:10.1f}")


if __name__ == "__main__":
    main()
